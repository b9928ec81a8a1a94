"""Files that survive crashes and careless or hostile input (:mod:`.safe_io`): durable atomic replacement,
reads of regular files only, and verified contents. Everything that writes a checkpoint, a run directory or
prepared data goes through it; it imports nothing else of trainmesh."""
