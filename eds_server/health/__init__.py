"""Active health checks run by eds-server itself, once for every Envoy (docs/health-checks.md).

spec.py (what to check, validated) and tracker.py (rise/fall counting, how a result combines with a
source's health) are plain data; probes.py does the IO of one check; checker.py schedules them and
lays their results over the store's groups. Nothing is imported here, so the plain-data modules stay
in the bottom layer.
"""
