"""Deployment the way NVIDIA-stack users deploy: the container image, Kubernetes manifests, the Dynamo graph and the
dashboards (docs/deploy.md). The Python modules here are what the image and the pods run besides the project itself:
the model repository rendered for the pod layout (:mod:`deploy.render_repository`), the GPU count from the memory
planner (:mod:`deploy.sizing`) and the Dynamo run folder (:mod:`deploy.dynamo_prepare`)."""
