"""Renders deploy/k8s's kustomizations without kustomize (not installable
here), for the tests. It covers exactly the features those files use and
refuses any other field, so a kustomization that grows past it fails loudly:

- `resources`: YAML files, or directories holding a kustomization.yaml;
- `images`: `name` with `newName` and/or `newTag`, on containers' `image`;
- `patches`: `path` to a strategic merge patch, matched by kind and name.
  Maps merge key by key, a key set to null is removed; lists of maps with a
  `name` merge entry by entry (containers, env, ports, volumes); other lists
  are replaced. A patch with `$patch: delete` removes its object.

`kubectl kustomize deploy/k8s` renders the same where kubectl is installed."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"resources", "images", "patches"}


def render(directory: Path) -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text()) or {}
    unknown = set(kustomization) - SUPPORTED
    if unknown:
        raise ValueError(f"{directory}: kustomization fields this renderer does not cover: {sorted(unknown)}")
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects.extend(render(path))
        else:
            objects.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    for patch_entry in kustomization.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise ValueError(f"{directory}: only `path` patches are covered: {patch_entry}")
        for patch in yaml.safe_load_all((directory / patch_entry["path"]).read_text()):
            targets = [obj for obj in objects if obj["kind"] == patch["kind"]
                       and obj["metadata"]["name"] == patch["metadata"]["name"]]
            if len(targets) != 1:
                raise ValueError(f"{directory}: patch {patch_entry['path']} matches {len(targets)} objects")
            if patch.get("$patch") == "delete":
                objects.remove(targets[0])
                continue
            merged = _merge(targets[0], patch)
            objects[objects.index(targets[0])] = merged
    for image in kustomization.get("images", []):
        if not set(image) <= {"name", "newName", "newTag"}:
            raise ValueError(f"{directory}: image fields not covered: {image}")
        objects = [_set_image(obj, image) for obj in objects]
    return objects


def _merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = _merge(merged[key], value) if key in merged else copy.deepcopy(value)
        return merged
    if (isinstance(base, list) and isinstance(patch, list) and base and patch
            and all(isinstance(item, dict) and "name" in item for item in [*base, *patch])):
        merged = copy.deepcopy(base)
        names = [item["name"] for item in merged]
        for item in patch:
            if item["name"] in names:
                index = names.index(item["name"])
                merged[index] = _merge(merged[index], item)
            else:
                merged.append(copy.deepcopy(item))
        return merged
    return copy.deepcopy(patch)


def _set_image(obj: dict[str, Any], image: dict[str, str]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    for container in [*pod.get("containers", []), *pod.get("initContainers", [])]:
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            name = image.get("newName", name)
            tag = image.get("newTag", tag)
            container["image"] = f"{name}:{tag}" if tag else name
    return obj
