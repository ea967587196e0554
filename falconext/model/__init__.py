"""The production cost model: an iteration's time of a TP x DP x PP layout under faults
(:mod:`.itertime`), which the controller and the S2/S3 planners price with, and the check
of a job's roles (:mod:`.roles`). Pure: no torch, no clock, no I/O; it imports no
falconext package above it (not mitigate/, not control/)."""
