"""Decoupled DiLoCo: learners train on their own, a CPU syncer merges their fragments through object storage."""

__version__ = "0.1.0"
