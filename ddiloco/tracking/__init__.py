"""Experiment tracking: TensorBoard event files under the run root's `tb/` and, optionally, an MLflow run;
fed through bounded queues so that no tracking call ever waits on a backend (`ddiloco.tracking.tracker`)."""
