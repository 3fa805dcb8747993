#!/usr/bin/env bash
# Sourced by the setup scripts (setup.sh, setup_dynamo.sh, side_venv.sh) and scripts/lock.sh: the pinned uv, and a
# shell function `uv` that runs it with this machine's pip configuration.
# - uv $PINNED_UV is installed once by pip into build/uv (build/uv/bin/uv); a second source only checks it is there.
# - uv reads no pip configuration, so what `pip config list` reports (pip.conf files and PIP_* variables) is translated
#   into uv's variables: index-url, extra-index-url, find-links, constraint, cert, client-cert, timeout, retries,
#   trusted-host, proxy, pre, no-cache-dir (no-index, only-binary, no-binary become options of `uv pip ...`). A UV_*
#   variable already set wins over pip's setting. UV_INDEX_STRATEGY=unsafe-best-match: like pip, uv weighs the
#   candidates of every index and find-links folder (by default it stops at the first index that has the package, and
#   could take another torch build than pip does).
# - the variables apply to uv only (the function passes them with `env`); `bash scripts/uv_env.sh` prints them.
# Sets PY: the interpreter of the venvs ($PYTHON, else python3.11, else python3).
PINNED_UV=0.13.10
PROJECT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PINNED_UV_DIR="$PROJECT_ROOT/build/uv"
PINNED_UV_BIN="$PINNED_UV_DIR/bin/uv"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
PY="$("$PY" -c 'import sys; print(sys.executable)')"  # the interpreter itself, not a shim (pyenv's are slow)

_uv_pip() {  # pip of $PY; where $PY has none (a distribution's python3.11 without python3-pip), a bootstrap venv's
    if "$PY" -c 'import pip' 2>/dev/null; then
        "$PY" -m pip "$@"
    else
        [ -x "$PROJECT_ROOT/build/uv-bootstrap/bin/python" ] || "$PY" -m venv "$PROJECT_ROOT/build/uv-bootstrap"
        "$PROJECT_ROOT/build/uv-bootstrap/bin/python" -m pip "$@"
    fi
}

_uv_install() {  # pip install uv==$PINNED_UV into build/uv unless it is there (a lock keeps parallel setups apart)
    [ -x "$PINNED_UV_BIN" ] && [ -d "$PINNED_UV_DIR/uv-$PINNED_UV.dist-info" ] && return 0
    mkdir -p "$PROJECT_ROOT/build"
    (
        command -v flock >/dev/null && flock 9
        [ -x "$PINNED_UV_BIN" ] && [ -d "$PINNED_UV_DIR/uv-$PINNED_UV.dist-info" ] && exit 0
        rm -rf "$PINNED_UV_DIR"
        log="$(mktemp)"
        if ! PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 \
                _uv_pip install --quiet --target "$PINNED_UV_DIR" "uv==$PINNED_UV" >"$log" 2>&1; then
            cat "$log" >&2; rm -f "$log"; echo "could not install uv==$PINNED_UV into $PINNED_UV_DIR" >&2; exit 1
        fi
        rm -f "$log"
    ) 9>"$PROJECT_ROOT/build/.uv-install.lock"
}

# pip's settings (`pip config list`: NAME='value', sections global < install < :env:) -> NAME=value lines for uv's
# environment and ARG lines for `uv pip` options
_UV_FROM_PIP='
import ast, sys
rank = {"global": 0, "install": 1, ":env:": 2}
conf = {}
for line in sys.stdin:
    name, sep, value = line.rstrip("\n").partition("=")
    section, _, key = name.rpartition(".")
    if not sep or section not in rank:
        continue
    try:
        value = str(ast.literal_eval(value))
    except (ValueError, SyntaxError):
        continue
    key = key.lower().replace("_", "-").lstrip("-")
    key = {"default-timeout": "timeout"}.get(key, key)  # two names of one pip option
    if key not in conf or conf[key][0] <= rank[section]:
        conf[key] = (rank[section], value)
conf = {k: v for k, (_, v) in conf.items()}
true = lambda k: conf.get(k, "").lower() in ("1", "true", "yes", "on")
out = []
def env(name, key, join=None):
    if conf.get(key, "").strip():
        out.append(f"{name}=" + (join.join(conf[key].split()) if join else conf[key].strip()))
env("UV_INDEX_URL", "index-url")
env("UV_EXTRA_INDEX_URL", "extra-index-url", " ")
env("UV_FIND_LINKS", "find-links", ",")
env("UV_CONSTRAINT", "constraint", " ")
env("UV_INSECURE_HOST", "trusted-host", " ")
env("SSL_CERT_FILE", "cert")
env("SSL_CLIENT_CERT", "client-cert")
env("HTTP_PROXY", "proxy")
env("HTTPS_PROXY", "proxy")
timeout = conf.get("timeout")
if timeout:
    out.append(f"UV_HTTP_TIMEOUT={max(1, round(float(timeout)))}")
retries = conf.get("retries")
if retries:
    out.append(f"UV_HTTP_RETRIES={int(retries)}")
if true("pre"):
    out.append("UV_PRERELEASE=allow")
if "no-cache-dir" in conf:  # pip: any value turns its cache off
    out.append("UV_NO_CACHE=1")
if conf.get("keyring-provider") == "subprocess":
    out.append("UV_KEYRING_PROVIDER=subprocess")
if true("no-index"):
    out.append("ARG=--no-index")
for key in ("only-binary", "no-binary"):
    for value in conf.get(key, "").split():
        out += [f"ARG=--{key}", f"ARG={value}"]
sys.stdout.write("".join(line + "\0" for line in out))
'

_uv_configure() {
    _uv_env=() _uv_pip_args=()
    local line name
    while IFS= read -r -d '' line; do
        name="${line%%=*}"
        if [ "$name" = ARG ]; then
            _uv_pip_args+=("${line#ARG=}")
        elif [[ "$name" != UV_* ]] || [ -z "${!name+x}" ]; then  # a UV_* variable set by the caller wins
            _uv_env+=("$line")
        fi
    done < <(PIP_DISABLE_PIP_VERSION_CHECK=1 _uv_pip config list 2>/dev/null | "$PY" -c "$_UV_FROM_PIP")
    [ -n "${UV_INDEX_STRATEGY+x}" ] || _uv_env+=(UV_INDEX_STRATEGY=unsafe-best-match)
    [ -n "${UV_PYTHON_DOWNLOADS+x}" ] || _uv_env+=(UV_PYTHON_DOWNLOADS=never)  # the venvs use $PY, never a download
    if [ -z "${UV_LINK_MODE+x}" ]; then  # hard links from uv's cache where it shares the project's file system
        local cache
        if [[ " ${_uv_env[*]} " == *" UV_NO_CACHE=1 "* ]] || [ -n "${UV_NO_CACHE:-}" ]; then
            _uv_env+=(UV_LINK_MODE=copy)  # a throw-away cache
        elif cache="$("$PINNED_UV_BIN" cache dir 2>/dev/null)" && mkdir -p "$cache" \
                && [ "$(stat -c %d "$cache")" != "$(stat -c %d "$PROJECT_ROOT")" ]; then
            _uv_env+=(UV_LINK_MODE=copy)
        fi
    fi
    return 0
}

uv() {  # uv with the translated pip configuration; `uv pip install|sync|compile` also get pip's options of that kind
    if [ "${1:-}" = pip ] && [[ "${2:-}" =~ ^(install|sync|compile)$ ]] && [ "${#_uv_pip_args[@]}" -gt 0 ]; then
        set -- pip "$2" "${_uv_pip_args[@]}" "${@:3}"
    fi
    env ${_uv_env[@]+"${_uv_env[@]}"} "$PINNED_UV_BIN" "$@"
}

_uv_install
_uv_configure

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run, not sourced: show what uv gets
    echo "$("$PINNED_UV_BIN" --version) ($PINNED_UV_BIN), python $PY"
    printf '%s\n' ${_uv_env[@]+"${_uv_env[@]}"}
    [ "${#_uv_pip_args[@]}" -eq 0 ] || echo "uv pip options: ${_uv_pip_args[*]}"
fi
