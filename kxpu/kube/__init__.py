"""The one place kxpu talks to the Kubernetes API server (lightkube): clients, watches, Leases, events.

- ``client``: one AsyncClient per process (field manager, kubeconfig), status-code tests, metadata
  accessors, events, non-resource GETs;
- ``watch``: the one list-then-watch loop (relist on any break, with backoff) every cache follows;
- ``review``: TokenReview + SubjectAccessReview for the node daemon's HTTP endpoints;
- ``dra``: the DRA driver's calls (its Node's UID, ResourceSlices, ResourceClaims, claim events);
- ``sharing/``: fractional sharing's calls (the extender's caches, node locks in Leases or annotations,
  bind, signing keys; the node daemon's link).

Each feature keeps its logic (the lock protocol, signatures, slices) in its own package and its API
traffic here: no other product module makes an API call (``kxpu.status`` borrows lightkube's quantity
parser, nothing more). Nothing below the node servers
imports it: backends and the device model stay free of Kubernetes. Importing this package loads no
lightkube: ``kxpu.kube.dra`` loads it on the driver's first API call.
"""
