"""The thin Kubernetes layer of sharing (lightkube): caches fed by watches, node locks, bind, events, keys.

Everything above it speaks plain dicts and dataclasses; only this package imports lightkube.
"""
