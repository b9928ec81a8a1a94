"""Pipeline parallelism: schedules as data (:mod:`.schedules`), their simulator/verifier
(:mod:`.simulate`) and timeline drawing (:mod:`.draw`)."""
