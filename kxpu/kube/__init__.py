"""The one place kxpu talks to the Kubernetes API server (lightkube): the client, typed helpers, events.

Every part that reads or writes API objects (sharing's node link and extender, the DRA driver's
ResourceSlice publisher and claim reader, ``kxpu status --cluster``) gets its client and helpers here,
so client settings (field manager, timeouts) live in one place. Nothing below the node servers
imports it: backends and the device model stay free of Kubernetes.
"""
