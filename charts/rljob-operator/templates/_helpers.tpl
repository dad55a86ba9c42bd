{{/*
Expand the name of the chart.
*/}}
{{- define "rljob-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Create a default fully qualified app name.
We truncate at 63 chars because some Kubernetes name fields are limited to this (by the DNS naming spec).
If release name contains chart name it will be used as a full name.
*/}}
{{- define "rljob-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Create chart name and version as used by the chart label.
*/}}
{{- define "rljob-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels
*/}}
{{- define "rljob-operator.labels" -}}
helm.sh/chart: {{ include "rljob-operator.chart" . }}
{{ include "rljob-operator.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rljob
{{- end }}

{{/*
Selector labels
*/}}
{{- define "rljob-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rljob-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Create the name of the service account to use
*/}}
{{- define "rljob-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rljob-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator image: repository:tag, the tag defaulting to the chart's appVersion.
*/}}
{{- define "rljob-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/*
The default worker image handed to the operator (RLJOB_WORKER_IMAGE).
*/}}
{{- define "rljob-operator.workerImage" -}}
{{- printf "%s:%s" .Values.worker.image.repository (.Values.worker.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/*
True (non-empty) when the operator serves every namespace, i.e. watchNamespaces is empty.
*/}}
{{- define "rljob-operator.clusterWide" -}}
{{- if not .Values.watchNamespaces }}true{{ end }}
{{- end }}

{{/*
Labels the operator puts on the training pods of every RLJob and on their metrics Services
(operator/rljob_operator/builders.py: selector_labels + app.kubernetes.io/component).
*/}}
{{- define "rljob-operator.workerManagedBy" -}}
app.kubernetes.io/managed-by: rljob-operator
{{- end }}

{{/*
namespaceSelector of the worker monitors: every namespace in cluster-wide mode, else the served ones.
*/}}
{{- define "rljob-operator.workerNamespaceSelector" -}}
{{- if include "rljob-operator.clusterWide" . }}
any: true
{{- else }}
matchNames:
{{- toYaml .Values.watchNamespaces | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Rules the operator needs in every namespace it serves (a ClusterRole in cluster-wide mode, a Role
per namespace otherwise). Derived from operator/rljob_operator/kube_io.py and kopf's own needs;
tests/chart/test_rbac.py asserts that these rules equal what the operator's code does, no more.
*/}}
{{- define "rljob-operator.namespacedRules" -}}
# RLJobs: kube_io reads each job (get); kopf watches them (list, watch) and patches its
# bookkeeping annotations and the finalizer its resync timer needs (patch). The per-job progress
# Role hands workers get+patch on their own RLJob, which the operator may grant only because it
# holds both itself (RBAC escalation prevention; no bind/escalate verbs).
- apiGroups: ["rljob.dev"]
  resources: ["rljobs"]
  verbs: ["get", "list", "watch", "patch"]
# Conditions, observedGeneration and trainer progress: merge patches of /status.
- apiGroups: ["rljob.dev"]
  resources: ["rljobs/status"]
  verbs: ["patch"]
# Children carry ownerReferences with blockOwnerDeletion; clusters enforcing owner-reference
# permissions (OwnerReferencesPermissionEnforcement, e.g. OpenShift) require this to create them.
- apiGroups: ["rljob.dev"]
  resources: ["rljobs/finalizers"]
  verbs: ["update"]
# The child PyTorchJob: read, create, suspend/resume (patch), delete when a suspended job's spec
# changed; kopf watches the ones labelled as ours.
- apiGroups: ["kubeflow.org"]
  resources: ["pytorchjobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The child JobSet (spec.childKind: JobSet): the same verbs as for PyTorchJobs.
- apiGroups: ["jobset.x-k8s.io"]
  resources: ["jobsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Kueue's Workloads: a queue-labelled child that no Workload owns after
# operator.kueueWorkloadGraceSeconds gets Admitted=False, reason NoKueueWorkload (kube_io lists them;
# kopf watches them to notice one appearing). Read-only.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list", "watch"]
# The <job>-spec ConfigMap: read, create, rewrite when a suspended job's spec changed.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
# Events on RLJobs, posted by kopf.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# The judge of spec.reward.server: Deployment and Service <job>-judge (owned by the RLJob); its readiness
# is read into the JudgeReady condition and it is scaled to 0 while the job is suspended or finished. The
# Service verb also creates the headless <job>-metrics Service of worker.metricsService.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["create"]
{{- if .Values.worker.progressRbac }}
# Per-job progress reporting (worker.progressRbac): ServiceAccount <job>-worker, Role and
# RoleBinding <job>-progress.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["create"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["create"]
{{- end }}
{{- if .Values.rbac.podMonitors }}
# PodMonitors requested by RLJobs with spec.metrics.podMonitor: true (rbac.podMonitors).
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["create"]
{{- end }}
{{- end }}

{{/*
Cluster-scoped rules kopf uses to observe the cluster (rbac.clusterDiscovery): CRDs (to notice the
PyTorchJob CRD installed after the operator started) and, in namespaced mode, Namespaces.
*/}}
{{- define "rljob-operator.discoveryRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if not (include "rljob-operator.clusterWide" .) }}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end }}
