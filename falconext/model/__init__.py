"""Models of time, pure (no torch, no clock): the production cost model, an iteration's time
of a TP x DP x PP layout under faults (:mod:`.itertime`), which the controller and the S2/S3
planners price with; the check of a job's roles (:mod:`.roles`); the emulated device's model
of compute and links (:mod:`.device`); and faults, what they slow and how a fault file reads
(:mod:`.faults`, whose file reading is its only I/O). It imports no falconext package above
it (not mitigate/, not control/)."""
