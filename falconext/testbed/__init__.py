"""The test bed: falconext's own trainer (small GPT on megatron-core), data, fault injector,
emulated device clock and links, CPU compatibility. Experiment tooling: nothing in the
pipeline (detect/, profile/, validate/, mitigate/, control/, runtime/) imports it."""
