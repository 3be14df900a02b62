"""kxpu as a Dynamic Resource Allocation driver: any backend's devices in ResourceSlices, claims prepared
into CDI specs, registered with the kubelet through plugin registration.

- ``names``, ``slices``, ``claims``, ``opaque``: pure — driver and device names, ResourceSlice content,
  reading a claim's allocation and per-claim config;
- ``checkpoint``, ``prepare``: NodePrepareResources / NodeUnprepareResources, their CDI specs and their
  record on disk;
- ``claim_status``, ``metadata``: what a prepared claim tells back, in its ``status.devices`` (written in the
  background) and as files in the container (KEP-5304);
- ``service``: the kubelet-facing gRPC services (DRAPlugin v1/v1beta1, health, registration);
- ``publisher`` + ``kube``: ResourceSlices in the API server (``kube`` is the only module here that
  imports the Kubernetes client);
- ``plugin``: one resource's DRA life (sockets, registration, slices), run by the node daemon.
"""
