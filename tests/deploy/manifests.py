"""Reading deploy/ as the tools would: compose's variable interpolation, a YAML-level kustomize
renderer (the subset of kustomize the manifests use), and the ``dsmesh`` argv of every
container and compose service."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "compose.yaml"
K8S = DEPLOY / "k8s"
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))


def load_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


# ------------------------------------------------------------------------------ compose ----

_VAR = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|([A-Za-z_]\w*))")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-d}``, ``${VAR-d}``,
    ``${VAR:?err}``, applied to every string of a loaded compose file."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3) or ""
        current = env.get(name)
        if op == ":-":
            return current if current else arg
        if op == "-":
            return current if current is not None else arg
        if op in (":?", "?") and not current:
            raise ValueError(f"compose: {name} is required: {arg}")
        return current or ""

    return _VAR.sub(sub, value)


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """compose.yaml with YAML merge keys resolved and variables interpolated from ``env``
    (default: nothing set, so every ``${VAR:-default}`` takes its default)."""
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    return interpolate(data, env or {})


def image_repo(image: str) -> str:
    """``registry/dsmesh:tag`` -> ``dsmesh``."""
    last = image.rsplit("/", 1)[-1]
    return last.split("@", 1)[0].split(":", 1)[0]


def is_dsmesh_image(image: str) -> bool:
    return image_repo(image) == "dsmesh"


def compose_dsmesh_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in compose["services"].items()
        if is_dsmesh_image(svc.get("image", ""))
    }


# -------------------------------------------------------------------- kustomize (subset) ----

CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "ClusterRole", "ClusterRoleBinding"}
BUILTIN_GROUPS = {"", "v1", "apps", "policy", "batch"}
SUPPORTED_FIELDS = {"apiVersion", "kind", "namespace", "resources", "patches", "images"}


class RenderError(AssertionError):
    pass


def group_of(obj: dict[str, Any]) -> str:
    api = obj.get("apiVersion", "")
    return api.split("/", 1)[0] if "/" in api else ""


def key_of(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def _smp(base: Any, patch: Any, builtin: bool) -> Any:
    """Strategic merge as kustomize does it for what these manifests patch: maps merge, null
    deletes, lists of named maps merge by name on built-in kinds, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = _smp(out[k], v, builtin)
            else:
                out[k] = copy.deepcopy(v)
        return out
    named = (
        builtin
        and isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and "name" in x for x in [*base, *patch])
    )
    if named:
        out_list = [copy.deepcopy(x) for x in base]
        index = {x["name"]: i for i, x in enumerate(out_list)}
        for item in patch:
            if item["name"] in index:
                out_list[index[item["name"]]] = _smp(out_list[index[item["name"]]], item, True)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"JSON patch path must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _json6902(obj: dict[str, Any], ops: list[dict[str, Any]], where: str) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    for op in ops:
        parts = _pointer(op["path"])
        parent: Any = obj
        for part in parts[:-1]:
            try:
                parent = parent[int(part)] if isinstance(parent, list) else parent[part]
            except (KeyError, IndexError, ValueError) as exc:
                raise RenderError(f"{where}: {op['path']} does not exist ({exc!r})") from None
        last = parts[-1]
        kind = op["op"]
        if isinstance(parent, list):
            if kind == "add":
                idx = len(parent) if last == "-" else int(last)
                parent.insert(idx, copy.deepcopy(op["value"]))
                continue
            idx = int(last)
            if not 0 <= idx < len(parent):
                raise RenderError(f"{where}: {op['path']} does not exist")
        elif kind in ("replace", "remove") and last not in parent:
            raise RenderError(f"{where}: {op['path']} does not exist")
        if kind in ("add", "replace"):
            parent[int(last) if isinstance(parent, list) else last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del parent[int(last) if isinstance(parent, list) else last]
        else:
            raise RenderError(f"{where}: JSON patch op {kind!r} not supported here")
    return obj


def _matches(obj: dict[str, Any], target: dict[str, Any]) -> bool:
    if "kind" in target and obj["kind"] != target["kind"]:
        return False
    if "name" in target and obj["metadata"]["name"] != target["name"]:
        return False
    if "group" in target and group_of(obj) != target["group"]:
        return False
    return "version" not in target or obj["apiVersion"].split("/")[-1] == target["version"]


def _split_image(image: str) -> tuple[str, str]:
    """``name:tag`` -> (name, ":tag"); a port in the registry host is not a tag."""
    name, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:
        return image, ""
    return name, f":{tag}"


def _set_images(node: Any, images: list[dict[str, Any]]) -> None:
    """kustomize's ``images``: every container of every object, whatever its kind."""
    if isinstance(node, dict):
        for field in ("containers", "initContainers"):
            for container in node.get(field) or []:
                name, tag = _split_image(container.get("image", ""))
                for rule in images:
                    if name == rule["name"]:
                        new_tag = f":{rule['newTag']}" if "newTag" in rule else tag
                        container["image"] = rule.get("newName", name) + new_tag
        for v in node.values():
            _set_images(v, images)
    elif isinstance(node, list):
        for v in node:
            _set_images(v, images)


def render(folder: Path) -> list[dict[str, Any]]:
    """The objects ``kustomize build folder`` makes, for the subset of kustomize used in
    deploy/k8s: resources (files and folders), namespace, images, patches (strategic merge
    from a file or inline, JSON 6902 inline with a target). Fails on anything else, on a patch
    whose target does not exist, and on duplicate objects."""
    kfile = folder / "kustomization.yaml"
    if not kfile.is_file():
        raise RenderError(f"{folder}: no kustomization.yaml")
    k = yaml.safe_load(kfile.read_text())
    unknown = set(k) - SUPPORTED_FIELDS
    if unknown:
        raise RenderError(f"{kfile}: fields this renderer does not model: {sorted(unknown)}")
    objects: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        path = (folder / res).resolve()
        if path.is_dir():
            objects += render(path)
        elif path.is_file():
            objects += load_all(path)
        else:
            raise RenderError(f"{kfile}: resource {res} does not exist")
    seen: set[tuple[str, str]] = set()
    for obj in objects:
        if key_of(obj) in seen:
            raise RenderError(f"{kfile}: duplicate {key_of(obj)}")
        seen.add(key_of(obj))
    for i, patch in enumerate(k.get("patches", [])):
        where = f"{kfile} patches[{i}]"
        if "path" in patch:
            docs = load_all(folder / patch["path"])
        else:
            docs = [yaml.safe_load(patch["patch"])]
        target = patch.get("target")
        for doc in docs:
            if isinstance(doc, list):  # JSON 6902
                if target is None:
                    raise RenderError(f"{where}: a JSON 6902 patch needs a target")
                hits = [j for j, o in enumerate(objects) if _matches(o, target)]
                if not hits:
                    raise RenderError(f"{where}: target {target} matches nothing")
                for j in hits:
                    objects[j] = _json6902(objects[j], doc, where)
            else:
                sel = target or {"kind": doc["kind"], "name": doc["metadata"]["name"]}
                hits = [j for j, o in enumerate(objects) if _matches(o, sel)]
                if not hits:
                    raise RenderError(f"{where}: {sel} matches no object")
                for j in hits:
                    builtin = group_of(objects[j]) in BUILTIN_GROUPS
                    body = {key: v for key, v in doc.items() if key not in ("apiVersion", "kind")}
                    body["metadata"] = {
                        key: v for key, v in doc.get("metadata", {}).items() if key != "name"
                    }
                    objects[j] = _smp(objects[j], body, builtin)
    if "namespace" in k:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = k["namespace"]
    if "images" in k:
        for obj in objects:
            _set_images(obj, k["images"])
    return objects


# --------------------------------------------------------------------- containers / argv ----


@dataclass(frozen=True)
class Container:
    """A dsmesh container of a rendered manifest: its argv with ``$(VAR)`` resolved the way
    the kubelet does, from its env, its envFrom ConfigMaps and (LeaderWorkerSet pods) the
    variables LWS injects."""

    where: str  # "Kind/name"
    spec: dict[str, Any]
    pod_spec: dict[str, Any]
    env: dict[str, str]
    argv: list[str]
    unresolved: list[str]


# Values the kubelet fills in at run time; sample values of the right shape.
FIELD_SAMPLES = {
    "status.podIP": "10.0.0.7",
    "metadata.name": "pod-0",
    "metadata.namespace": "dsmesh",
    "spec.nodeName": "node-0",
}
_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def pod_specs(obj: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """(pod template, variables injected by the controller) of a workload object."""
    kind = obj["kind"]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return [(obj["spec"]["template"], {})]
    if kind == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        size = lwt.get("size", 1)
        lws_env = {
            "LWS_GROUP_SIZE": str(size),
            "LWS_WORKER_INDEX": str(size - 1),
            "LWS_LEADER_ADDRESS": f"{obj['metadata']['name']}-0.{obj['metadata']['name']}",
            "LWS_NAME": obj["metadata"]["name"],
        }
        out = [(lwt["workerTemplate"], lws_env)]
        if "leaderTemplate" in lwt:
            out.append((lwt["leaderTemplate"], {**lws_env, "LWS_WORKER_INDEX": "0"}))
        return out
    return []


def dsmesh_containers(objects: list[dict[str, Any]]) -> list[Container]:
    config_maps = {
        o["metadata"]["name"]: o.get("data") or {} for o in objects if o["kind"] == "ConfigMap"
    }
    out = []
    for obj in objects:
        for template, injected in pod_specs(obj):
            pod = template["spec"]
            for c in pod.get("containers", []):
                if not is_dsmesh_image(c.get("image", "")):
                    continue
                env: dict[str, str] = dict(injected)
                for src in c.get("envFrom", []):
                    ref = src.get("configMapRef", {}).get("name")
                    env.update({k: str(v) for k, v in config_maps.get(ref, {}).items()})
                for item in c.get("env", []):
                    if "value" in item:
                        env[item["name"]] = _REF.sub(
                            lambda m, e=env: e.get(m.group(1), m.group(0)), str(item["value"])
                        )
                    elif "fieldRef" in item.get("valueFrom", {}):
                        env[item["name"]] = FIELD_SAMPLES[
                            item["valueFrom"]["fieldRef"]["fieldPath"]
                        ]
                    else:
                        env[item["name"]] = "secret"
                unresolved: list[str] = []

                def resolve(
                    m: re.Match[str], env: dict[str, str] = env, bad: list[str] = unresolved
                ) -> str:
                    if m.group(1) not in env:
                        bad.append(m.group(1))
                        return m.group(0)
                    return env[m.group(1)]

                argv = [
                    _REF.sub(resolve, str(a)) for a in [*c.get("command", []), *c.get("args", [])]
                ]
                where = f"{obj['kind']}/{obj['metadata']['name']}"
                out.append(Container(where, c, pod, env, argv, unresolved))
    return out
