"""A run in its store: the run root, global versions and their fragments, preparing and joining a run."""
