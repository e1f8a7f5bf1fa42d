"""KubeRay ``RayService`` manifests for meshserve on GKE TPU slices: ``meshserve k8s render``.

Modules: ``tpu`` (GKE's TPU generations, topologies and VM shapes), ``deployment`` (the choices a
manifest is rendered from), ``manifest`` (the renderer: ``render``, ``to_yaml``), ``examples``
(the manifests committed in ``k8s/``) and ``cli``. Nothing is imported here, so that registering
the subcommand loads only what its flags need.
"""
