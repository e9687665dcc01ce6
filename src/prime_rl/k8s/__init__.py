"""Kubernetes manifests of an RL run (`rl --k8s...`): manifests.py."""
