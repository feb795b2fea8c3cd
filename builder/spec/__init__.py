"""What to build: the build spec (`build_spec`: `BuildSpec` and its sections, each field checked on
its own), the deployment section, the hardware profiles and the torch target on a GPU."""
