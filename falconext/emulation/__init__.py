"""Where there is no GPU, or a fault is wanted on purpose: the emulated device (a device model's
time for real computation), the CPU stand-ins megatron-core needs, and fault injection (a slower
device or link on the emulated device, a busy kernel on a real GPU). Experiment tools: nothing in
detect/, profile/, validate/ or mitigate/ imports them, and detection never reads them."""
