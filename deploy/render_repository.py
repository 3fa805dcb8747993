"""Render the model repository a pod serves: the project's configs for the pod layout (:mod:`deploy.layout`), with
the sizes and limits an operator sets in a ConfigMap.

    python -m deploy.render_repository --out /opt/mol2/serving/model_repository [--parameters-dir /etc/mol2/parameters]

The image runs it at build time (so `docker run` serves at once) and the pod's init container runs it again with the
ConfigMap mounted, into an emptyDir over the same path: a size change is a ConfigMap edit and a rollout, not an image
build. It is `tritonserver_backend.repository.build_repository` (configs from the tensor contract plus each model's
model.py) with the layout's paths; nothing here knows the configs' format.

Why refuse instead of ignore: a misspelt key in the ConfigMap (`max_active_turn`) would otherwise leave the default in
force without a word, and a path key would point the server away from the pod's mounts; both fail the init container,
which the pod's events show.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deploy.layout import POD_PARAMETERS
from tritonserver_backend.repository import DEFAULT_PARAMETERS, build_repository


class ParameterError(ValueError):
    """A ConfigMap entry that is not a model parameter, or one the pod layout fixes."""


def read_parameters_dir(folder: Path) -> dict[str, str]:
    """One model parameter per file (a mounted ConfigMap: file name = key, content = value). Kubernetes' own entries
    (`..data`, `..2026_...`) are skipped; values are stripped of surrounding whitespace."""
    values: dict[str, str] = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.is_dir():
            continue
        values[path.name] = path.read_text().strip()
    return values


def pod_parameters(overrides: dict[str, str], remap: dict[str, str] | None = None) -> dict[str, str]:
    """The parameters of the pod's repository: project defaults, the layout's paths, then the operator's overrides.

    ``remap`` replaces path prefixes in the layout's paths (tests render the same repository into a temporary folder
    that stands for the pod's filesystem). Raises :class:`ParameterError` for unknown keys and for layout keys."""
    unknown = sorted(set(overrides) - set(DEFAULT_PARAMETERS))
    if unknown:
        raise ParameterError(
            f"not model parameters: {', '.join(unknown)} (known: {', '.join(sorted(DEFAULT_PARAMETERS))})"
        )
    fixed = sorted(set(overrides) & set(POD_PARAMETERS))
    if fixed:
        raise ParameterError(f"set by the pod layout, not the ConfigMap: {', '.join(fixed)} (deploy/layout.py)")
    layout = dict(POD_PARAMETERS)
    for old, new in (remap or {}).items():
        layout = {
            k: ":".join(new + part[len(old) :] if part.startswith(old) else part for part in v.split(":"))
            for k, v in layout.items()
        }
    return {**DEFAULT_PARAMETERS, **layout, **overrides}


def render(out: Path, overrides: dict[str, str] | None = None, remap: dict[str, str] | None = None) -> Path:
    """Write the repository (configs + model.py files) into ``out``; returns ``out``."""
    return build_repository(out, pod_parameters(overrides or {}, remap))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the model repository to write")
    parser.add_argument("--parameters-dir", type=Path, help="a mounted ConfigMap: one file per model parameter")
    parser.add_argument(
        "--remap",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="replace a path prefix of the layout (tests: a temporary folder for the pod's filesystem)",
    )
    args = parser.parse_args(argv)
    overrides = read_parameters_dir(args.parameters_dir) if args.parameters_dir else {}
    remap = dict(item.split("=", 1) for item in args.remap)
    try:
        out = render(args.out, overrides, remap)
    except ParameterError as exc:
        print(f"render_repository: {exc}", file=sys.stderr)
        return 2
    shown = ", ".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "none"
    print(f"rendered {out} (ConfigMap parameters: {shown})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
