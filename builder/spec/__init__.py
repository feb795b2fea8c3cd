"""What to build: the build spec, its checks across sections, the hardware profiles."""
