"""`layerswarm token`: make a swarm token on first start, so no deployment runs open or asks for a secret.

layerswarm token swarm.token                 # a new random token in swarm.token (mode 600), unless it has one
layerswarm token --k8s-secret layerswarm-token   # the same as a Kubernetes Secret, from inside a pod

docker-compose.yml runs the first as a one-shot service on a shared volume, deploy/systemd's unit as
ExecStartPre, deploy/k8s the second as a Job (its service account may create that one Secret), and
deploy/push-nodes.sh makes the file before it copies it to every board.
"""

from __future__ import annotations

import argparse
import base64
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

from layerswarm.wire.auth import ensure_token_file, new_token

from .base import Subparsers, UsageError, add_command

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
API = "https://kubernetes.default.svc"
SECRET_KEY = "token"  # the key in the Secret: mounted as a file of that name


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "token",
        run,
        help="make a swarm token (a file, or a Kubernetes Secret) unless there is one",
        description="Make a new random swarm token for --token-file unless one exists: deployments run this "
        "on first start, so a swarm is never open by default and nobody types a secret. Give every node and "
        "the coordinator the same token.",
    )
    p.add_argument("file", nargs="?", type=Path, help="the token file to make (kept when it holds a token)")
    p.add_argument(
        "--k8s-secret",
        metavar="NAME",
        help="instead of a file: make the Secret NAME (key `token`) in this pod's namespace unless it exists, "
        "with the pod's service account (deploy/k8s/token.yaml)",
    )


def run(args: argparse.Namespace) -> int:
    if (args.file is None) == (args.k8s_secret is None):
        raise UsageError("give either FILE or --k8s-secret NAME")
    if args.file is not None:
        try:
            made = ensure_token_file(args.file)
        except OSError as exc:
            raise UsageError(f"{args.file}: cannot write the token ({exc.strerror})") from None
        print(f"{'made a new swarm token in' if made else 'kept the swarm token in'} {args.file}")
        return 0
    made = ensure_k8s_secret(args.k8s_secret)
    print(f"{'made the Secret' if made else 'kept the Secret'} {args.k8s_secret}")
    return 0


def ensure_k8s_secret(name: str, api: str = API, account: Path = SERVICE_ACCOUNT) -> bool:
    """Create the Secret `name` holding a new token unless it exists; True when made. 409 (another pod
    made it meanwhile) counts as kept."""
    try:
        namespace = (account / "namespace").read_text().strip()
        bearer = (account / "token").read_text().strip()
    except OSError as exc:
        raise UsageError(f"--k8s-secret: no service account in this pod ({exc.strerror}: {exc.filename})") from None
    ca = account / "ca.crt"
    context = ssl.create_default_context(cafile=str(ca)) if ca.is_file() else None
    url = f"{api}/api/v1/namespaces/{namespace}/secrets"
    headers = {"Authorization": f"Bearer {bearer}", "Content-Type": "application/json"}
    if _status(urllib.request.Request(f"{url}/{name}", headers=headers), context) == 200:
        return False
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "layerswarm"}},
        "type": "Opaque",
        "data": {SECRET_KEY: base64.b64encode(new_token().encode()).decode()},
    }
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    status = _status(request, context)
    if status in (200, 201):
        return True
    if status == 409:
        return False
    raise UsageError(f"--k8s-secret {name}: the API answered {status} (may this pod's service account create it?)")


def _status(request: urllib.request.Request, context: ssl.SSLContext | None) -> int:
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError) as exc:
        raise UsageError(f"--k8s-secret: cannot reach the Kubernetes API at {request.full_url} ({exc})") from None
