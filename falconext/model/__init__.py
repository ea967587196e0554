"""Models of time: how long work takes on a device and over links, and how a fault changes it."""
