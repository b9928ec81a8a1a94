"""The ranks of a job and how they talk: the device mesh (:mod:`.mesh`), the counted collectives
(:mod:`.comm`) and the one-host shared-memory transport (:mod:`.shm`), the devices and clusters a run or a plan is priced on (:mod:`.hardware`), the local launcher (:mod:`.launcher`)
and torch's elastic agent (:mod:`.elastic`), the check that ranks agree before step 1 (:mod:`.agreement`),
the multi-node test bed of network namespaces (:mod:`.testbed`) and the N-rank harness tests use
(:mod:`.testing`)."""
