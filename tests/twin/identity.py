"""A stand-in for EKS's pod identity webhook (IRSA: aws/amazon-eks-pod-identity-webhook, pkg/handler): a pod
whose service account is bound to an IAM role (the annotation `eks.amazonaws.com/role-arn`) gets, in every
container, `AWS_ROLE_ARN`, `AWS_WEB_IDENTITY_TOKEN_FILE` (a projected service-account token with audience
`sts.amazonaws.com`, mounted at /var/run/secrets/eks.amazonaws.com/serviceaccount/token) and
`AWS_STS_REGIONAL_ENDPOINTS=regional`; a container that sets `AWS_ROLE_ARN` itself keeps its own.
Nothing else of the webhook (no volume objects, no region variables, no token rotation).

The twin's pods are local processes: the token is a file the test writes, and its path stands for the mount.
Both kinds of pods get it: KFP's task pods (as `Cluster.service_account`) and the pods a step creates (as
their `serviceAccountName`)."""

from __future__ import annotations

from dataclasses import dataclass

ROLE_ANNOTATION = "eks.amazonaws.com/role-arn"


@dataclass(frozen=True)
class WebIdentity:
    role_arn: str
    token_file: str
    """The token's path (the projected volume's mount in a real pod)."""


def identity_env(identities: dict[str, WebIdentity], service_account: str) -> dict[str, str]:
    """What the webhook adds to a container of a pod running as `service_account` (before the container's
    own env, which wins)."""
    identity = identities.get(service_account)
    if identity is None:
        return {}
    return {
        "AWS_ROLE_ARN": identity.role_arn,
        "AWS_WEB_IDENTITY_TOKEN_FILE": identity.token_file,
        "AWS_STS_REGIONAL_ENDPOINTS": "regional",
    }
