"""The rljob operator: reconciles RLJobs into Kubeflow PyTorchJobs.

    kopf run -m rljob_operator.handlers --namespace NS     # or: python -m rljob_operator --namespace NS

Modules, from pure to side-effecting:

- ``settings``    operator configuration from the environment (``OperatorSettings.from_env``).
- ``conditions``  condition types, reasons and pure helpers for status conditions.
- ``progress``    the worker -> operator progress annotation (stdlib only; the worker imports it).
- ``builders``    pure child builders: spec ConfigMap, PyTorchJob, progress RBAC, metrics objects.
- ``reconcile``   the one pure, level-based ``reconcile(body, observed, settings) -> Plan``.
- ``kube_io``     every Kubernetes API call (kubernetes client), events included.
- ``metrics``     the operator's Prometheus metrics (prometheus-client).
- ``handlers``    thin kopf handlers: observe, reconcile, apply.

This file imports nothing, so ``import rljob_operator.progress`` stays light in the worker image.
"""
