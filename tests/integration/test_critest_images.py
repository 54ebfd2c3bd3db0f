"""The critest look-alike images carry what critest's image specs check (users, tags, distinct images)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shim.image_store import ImageStore
from tests.critest_images import E2E, STAGING, push_all, registries_config
from tests.integration.image_setup import Pushed, pull, pushed  # noqa: F401
from vmsandbox.registries import parse_registries

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_look_alikes(pushed: Pushed, tmp_path: Path) -> None:  # noqa: F811
    host = pushed.registry.host
    refs = push_all(host, tmp_path / "work")
    assert f"{host}/{E2E}/busybox:1.29-2" in refs
    assert {f"{host}/{E2E}/httpd:2.4.39-4", f"{host}/{E2E}/nonewprivs:1.3", f"{host}/{E2E}/nginx:1.14-2"} <= set(refs)
    store = ImageStore(tmp_path / "images")
    users = {}
    for name in ("uid", "username", "uid-group", "username-group"):
        image_id = pull(store, f"{host}/{STAGING}/test-image-user-{name}")
        record = store.get(image_id)
        assert record is not None
        users[name] = (record.spec["uid"], record.spec["username"])
    assert users == {
        "uid": (1002, ""),
        "username": (None, "www-data"),
        "uid-group": (1003, ""),
        "username-group": (None, "www-data"),
    }
    tags = {pull(store, f"{host}/{STAGING}/test-image-tags:{t}") for t in ("1", "2", "3")}
    distinct = {pull(store, f"{host}/{STAGING}/test-image-{n}:latest") for n in ("1", "2", "3")}
    assert len(tags) == 1 and len(distinct) == 3
    record = store.get(tags.pop())
    assert record is not None and len(record.repo_tags) == 3

    upstream = ImageStore(tmp_path / "upstream", registries=parse_registries(registries_config(host)))
    names = ("registry.k8s.io/pause:3.9", "k8s.gcr.io/pause:3.9", "gcr.io/k8s-staging-cri-tools/test-image-tag:test")
    ids = [pull(upstream, n) for n in names]
    assert ids[0] == ids[1] != ids[2]
    pause = upstream.get(ids[0])
    assert pause is not None and pause.repo_tags == ("k8s.gcr.io/pause:3.9", "registry.k8s.io/pause:3.9")
