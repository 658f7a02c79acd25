# eds-server image: `docker build -t eds-server .`, or `docker compose up --build` (compose.yaml).
# Runs `eds-server serve --docker` as an unprivileged user; see docs/docker.md for
# giving it the Docker socket (group_add) or a read-only socket proxy (DOCKER_HOST).

# Pinned to a patch release; bump deliberately.
FROM python:3.12.14-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# A fixed, unprivileged uid/gid (no home, no shell). Access to the Docker socket is given at run
# time through the socket's group: `group_add` in compose.yaml, `--group-add` with docker run.
RUN groupadd --system --gid 10001 eds \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin eds

WORKDIR /src

# Layer 1, rebuilt only when pyproject.toml or constraints.txt change: the runtime dependencies
# (pyproject's [project].dependencies and the kubernetes extra, as deploy/kubernetes/ runs this
# image; no demo or dev extras) at the versions pinned in constraints.txt.
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['kubernetes']))" \
        > /tmp/requirements.txt \
 && pip install -c constraints.txt -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# Layer 2, rebuilt on every source change (cheap: no dependency is installed again).
COPY README.md LICENSE ./
COPY eds_server ./eds_server
RUN pip install --no-deps -c constraints.txt . \
 && pip check \
 && rm -rf /src

WORKDIR /
USER 10001:10001

# gRPC (EDS); the admin HTTP stays on the container's 127.0.0.1:18001 unless --admin says otherwise.
# --listen defaults to loopback (127.0.0.1:18000); in a container that reaches nobody, so the CMD says
# 0.0.0.0:18000 (every interface of the container: only what its network and published ports allow).
EXPOSE 18000

# Ready once every source has delivered its first state (GET /readyz on the admin port), with the
# stdlib only. http.client ignores HTTP(S)_PROXY, unlike urllib. Any error or non-200 exits 1.
# Assumes the default --admin 127.0.0.1:18001 (0.0.0.0:18001 works too); with --admin off, give
# the container another healthcheck or `healthcheck: {disable: true}`.
HEALTHCHECK --interval=5s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import http.client, sys; c = http.client.HTTPConnection('127.0.0.1', 18001, timeout=2); c.request('GET', '/readyz'); sys.exit(c.getresponse().status != 200)"]

# SIGTERM (docker stop) ends open streams cleanly; eds-server is PID 1 and handles it.
ENTRYPOINT ["eds-server"]
CMD ["serve", "--docker", "--listen", "0.0.0.0:18000"]
