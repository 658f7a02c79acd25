"""The Kubernetes configuration: where it is read from, what is wrong with it, and loading it again.

kubernetes_asyncio does configuration and authentication (kubeconfig, in-cluster service account
with the token re-read as it rotates), and its ApiClient adds fresh credentials to each request.
The configuration's files (kubeconfig, the certificates it names) are watched by their stat: a
rewritten kubeconfig (a rotated token, CA or server) is loaded before the next attempt; credentials
the API server refuses (401) load it again too, at most every 10 s however many watches ask. Apart
from the source, so that what is loaded, when, and what is said when it cannot be, reads without the
list and watch around it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from ..ratelimit import LogBudget
from .base import FileStamps
from .kubernetes_map import KubernetesOptions

log = logging.getLogger("eds_server.sources.kubernetes")

RELOAD_EVERY = 10.0  # seconds between loads for refused credentials, however many watches ask


class ConfigProblem(Exception):
    """The Kubernetes configuration cannot be used (a kubeconfig that is not YAML, a CA file that does
    not exist...): said in one line naming the file, as the operator's to fix, not the API server's."""


async def make_client(options: KubernetesOptions) -> Any:
    """An ApiClient from --kubeconfig, else KUBECONFIG, else in-cluster, else ~/.kube/config;
    ConfigProblem when the configuration found cannot be used."""
    from kubernetes_asyncio import client, config  # imported only when Kubernetes is followed (~1 s)

    logging.getLogger("kubernetes_asyncio").setLevel(logging.ERROR)  # our own warning says it, once

    cfg = client.Configuration()
    files = config_files(options)
    try:
        if options.kubeconfig:
            await config.load_kube_config(config_file=options.kubeconfig, client_configuration=cfg)
        elif in_cluster():
            # try_refresh_token: the service account token file is read again every minute (it rotates)
            config.load_incluster_config(client_configuration=cfg, try_refresh_token=True)  # type: ignore[no-untyped-call]
        else:
            await config.load_kube_config(client_configuration=cfg)
    except Exception as e:
        raise ConfigProblem(config_problem(e, files)) from None
    return client.ApiClient(cfg)


def config_problem(e: BaseException, files: list[str]) -> str:
    """What is wrong with the configuration, in one line naming the file (the library's words run over
    several lines, and some, such as a TypeError for an empty file, say nothing of the file)."""
    import yaml

    where = ", ".join(files) or "the in-cluster service account (/var/run/secrets/kubernetes.io/serviceaccount)"
    missing = [f for f in files if not os.path.exists(f)]
    if missing and len(missing) == len(files):
        return f"{where}: no such file"
    mark = getattr(e, "problem_mark", None)
    if isinstance(e, yaml.YAMLError) and mark is not None:
        problem = getattr(e, "problem", None) or "syntax error"
        return f"{mark.name}:{mark.line + 1}:{mark.column + 1}: not YAML: {problem}"
    if isinstance(e, yaml.YAMLError):
        return f"{where}: not YAML: {one_line(str(e))}"
    text = one_line(str(e))
    if text.startswith("File does not exists: "):  # the library's words for a CA, certificate or key file
        return f"{where} names a file that does not exist: {text.removeprefix('File does not exists: ')}"
    if isinstance(e, TypeError | AttributeError | KeyError):  # an empty file, or not a mapping
        return f"{where}: not a kubeconfig (empty, or not a mapping of clusters, users and contexts)"
    return f"{where}: {text or type(e).__name__}"


def one_line(text: str) -> str:
    return " ".join(text.split())


def missing_configuration(kubeconfig: str | None) -> str | None:
    """Why --kubernetes can never work as started, or None: no --kubeconfig, not in a cluster, and no
    kubeconfig file where KUBECONFIG or the default (~/.kube/config) says."""
    if kubeconfig or in_cluster():
        return None
    files = config_files(KubernetesOptions())
    if any(os.path.exists(f) for f in files):
        return None
    return (
        f"no Kubernetes configuration: not in a cluster (KUBERNETES_SERVICE_HOST is not set), no --kubeconfig, "
        f"and no {' or '.join(files) or 'kubeconfig'}: give --kubeconfig FILE or set KUBECONFIG"
    )


def in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and not os.environ.get("KUBECONFIG")


def config_files(options: KubernetesOptions) -> list[str]:
    """The kubeconfig files make_client reads (none in-cluster: the library re-reads that token)."""
    if options.kubeconfig:
        return [options.kubeconfig]
    if in_cluster():
        return []
    paths = os.environ.get("KUBECONFIG") or "~/.kube/config"
    return [os.path.expanduser(p) for p in paths.split(os.pathsep) if p]


def cert_files(api: Any) -> list[str]:
    """The CA, client certificate and key files a loaded configuration names (a rotated CA or
    client certificate is a rewrite of one of these, not of the kubeconfig)."""
    cfg = api.configuration
    return [str(f) for f in (cfg.ssl_ca_cert, cfg.cert_file, cfg.key_file) if f and os.path.isfile(str(f))]


class Configuration:
    """The ApiClient in use (`api`, None until the first load), made again when the configuration's
    files change or the API server refuses the credentials; `loaded(host)` is told each new one's
    server. `loads` counts the loads (one more per rotation), for tests."""

    def __init__(self, options: KubernetesOptions, name: str, loaded: Callable[[str], None] | None = None) -> None:
        self.options, self.name, self.loaded = options, name, loaded
        self.api: Any = None
        self.loads = 0
        self.loaded_at = 0.0  # loop time of the last load
        self._lock = asyncio.Lock()
        self._reloads_said = LogBudget(log, most=1, window=300.0)
        self._stamps = FileStamps(config_files(options))  # the configuration's files as last loaded

    def changed(self) -> bool:
        """Whether the configuration's files changed since they were last loaded (or tried)."""
        return self._stamps.changed()

    async def rewritten(self) -> bool:
        """`changed`, as a backoff's check."""
        return self._stamps.changed()

    async def reload(self, *, changed: bool = False) -> None:
        """(Re)load the configuration and credentials: on a 401 at most every RELOAD_EVERY s however
        many watches ask; with `changed`, once per rewrite of its files."""
        async with self._lock:
            now = asyncio.get_running_loop().time()
            if self.api is not None and (not self.changed() if changed else now - self.loaded_at < RELOAD_EVERY):
                return
            files = config_files(self.options)
            before = FileStamps(files)  # taken first: a write during the load is seen as a change next time
            try:
                api = await make_client(self.options)
            except Exception:
                self._stamps = before  # this version of the files is not tried again; the next one is
                raise
            stamps = FileStamps([*files, *cert_files(api)])
            stamps.seen = before.seen + stamps.seen[len(files) :]
            old, self.api, self.loaded_at, self._stamps = self.api, api, now, stamps
            if self.loaded is not None:
                self.loaded(str(api.configuration.host))
            self.loads += 1
            if old is not None and changed:
                log.info("%s: configuration loaded again (its files changed); watches resume with it", self.name)
            elif old is not None:  # every 10 s for as long as a 401 lasts: said now and then, with a count
                self._reloads_said.log(
                    logging.INFO,
                    "%s: configuration loaded again (the credentials were refused); watches resume with it",
                    self.name,
                )
                await old.close()  # watches on it end and resume on the new one

    async def close(self) -> None:
        if self.api is not None:
            await self.api.close()
