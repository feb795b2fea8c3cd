"""The emitted Triton repository: written from the templates, with the options a spec may tune."""
