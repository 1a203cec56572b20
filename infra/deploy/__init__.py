"""``ferry deploy``: a cluster's deployment artefacts, rendered from the same ClusterSpec as
``ferry up`` (``k8s``: Kubernetes manifests)."""
