"""Where things live in the image and in a pod: one place, so that the Dockerfile, the manifests, the rendered model
repository and the tests agree (tests/deploy checks the manifests' mounts against these paths).

The image holds the project (read-only); everything a pod writes or is given lives under STATE or /etc/mol2, each a
volume of its own so that Kubernetes decides what persists (engines, adapters) and what starts fresh (registry).
"""

from __future__ import annotations

from pathlib import PurePosixPath as P

PROJECT = P("/opt/mol2")  # the checkout, installed by scripts/setup.sh into PROJECT/.venv (and .venv-dynamo)
VENV = PROJECT / ".venv"
DYNAMO_VENV = PROJECT / ".venv-dynamo"
MODEL_DIR = PROJECT / "embedded" / "mol2-small"  # the embedded default, part of the checkout
MODEL_REPOSITORY = PROJECT / "serving" / "model_repository"  # rendered at image build, re-rendered by the pod's init

STATE = P("/var/lib/mol2")
ENGINES = STATE / "engines"  # volume: engines built on the node that runs them (init container) or mounted prebuilt
ENGINE_DIR = ENGINES / "mol2-small"
REGISTRY_ROOT = STATE / "registry"  # per pod, writable: registry.json, audit.log, adapters loaded through admin
ADAPTERS = STATE / "adapters"  # volume, read-only in the pod: adapters the operator provides (inside adapter_roots)
DYNAMO_RUN = STATE / "run"  # Dynamo graph: the shared run folder (discovery files, registry, frontend model folder)

ADMIN_KEY_FILE = P("/etc/mol2/admin/admin.key")  # admin_key_file: a 0600 copy of the Secret, owned by the server
ADMIN_SECRET_DIR = P("/etc/mol2/admin-secret")  # the Secret mounted as Kubernetes mounts it (0440 under fsGroup)
PARAMETERS_DIR = P("/etc/mol2/parameters")  # ConfigMap: one file per model-config parameter (sizes, limits)

UID = 1000  # the image's non-root user (NGC's triton-server user has this uid)
HTTP_PORT, GRPC_PORT, METRICS_PORT = 8000, 8001, 8002  # Triton's defaults, what the probes and Service use

# model-config parameters the layout fixes (tritonserver_backend/repository.py DEFAULT_PARAMETERS); a ConfigMap may
# not change them, or the paths would stop matching the pod's mounts
POD_PARAMETERS = {
    "model_dir": str(MODEL_DIR),
    "registry_root": str(REGISTRY_ROOT),
    "engine_dir": str(ENGINE_DIR),
    "admin_key_file": str(ADMIN_KEY_FILE),
    "adapter_roots": str(ADAPTERS),
}
