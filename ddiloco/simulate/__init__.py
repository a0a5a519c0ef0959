"""The paper's large-scale tables by simulation: goodput under chip failures, and WAN bandwidth needs."""
