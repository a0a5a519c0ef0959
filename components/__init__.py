"""Thin Kubeflow Pipelines components: each one calls one `ddiloco` role and logs what the role returned.

`ddiloco.components.roles` holds the KFP components (it imports kfp); `ddiloco.components.runtime` is the few lines every
component body calls (run the role, log its JSON as KFP metrics); `ddiloco.components.images` names the images,
tagged with the package version so a component and its image cannot drift apart.
"""
