#!/usr/bin/env bash
# Real-cluster end-to-end test of rljob (see e2e/README.md).
#   e2e/run-cluster.sh [--kind CLUSTER] [--cpu-worker] [--skip-training-operator] [--jobset] [--keep]
# Env: REGISTRY (push images there instead of kind load), S3_ENDPOINT/AWS_* (use an existing S3),
#      TRAINING_OPERATOR_REF (kustomize ref, default v1.9.2), JOBSET_VERSION (release whose
#      manifests.yaml --jobset installs, default v0.8.1), TIMEOUT (seconds per wait, default 900).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

KIND_CLUSTER="" CPU_WORKER=0 SKIP_TO=0 KEEP=0 JOBSET=0
while [ $# -gt 0 ]; do
  case "$1" in
    --kind) KIND_CLUSTER="$2"; shift 2 ;;
    --cpu-worker) CPU_WORKER=1; shift ;;
    --skip-training-operator) SKIP_TO=1; shift ;;
    --keep) KEEP=1; shift ;;
    --jobset) JOBSET=1; shift ;;
    -h|--help) sed -n 2,7p "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
NS=rljob-e2e
TIMEOUT="${TIMEOUT:-900}"
TAG="e2e-$(date +%s)"
log() { echo "[e2e $(date +%T)] $*"; }

if ! kubectl version --request-timeout=5s >/dev/null 2>&1; then
  log "no Kubernetes cluster reachable (kubectl version failed); nothing to do."
  log "create one, e.g. 'kind create cluster --name rljob', then run: e2e/run-cluster.sh --kind rljob --cpu-worker"
  exit 0
fi
for tool in helm docker; do
  command -v "$tool" >/dev/null || { echo "e2e needs $tool on PATH" >&2; exit 1; }
done

# 1. images
OP_IMAGE="${REGISTRY:-rljob}/operator:$TAG"
WK_IMAGE="${REGISTRY:-rljob}/worker:$TAG"
log "building $OP_IMAGE"
docker build -f Dockerfile.operator -t "$OP_IMAGE" .
if [ "$CPU_WORKER" = 1 ]; then
  log "building CPU worker $WK_IMAGE"
  docker build -f e2e/Dockerfile.worker-cpu -t "$WK_IMAGE" .
else
  docker build -f Dockerfile.worker -t "$WK_IMAGE" .
fi
if [ -n "$KIND_CLUSTER" ]; then
  kind load docker-image --name "$KIND_CLUSTER" "$OP_IMAGE" "$WK_IMAGE"
elif [ -n "${REGISTRY:-}" ]; then
  docker push "$OP_IMAGE"; docker push "$WK_IMAGE"
fi

cleanup() {
  [ "$KEEP" = 1 ] && { log "--keep: leaving namespace $NS and release rljob-e2e"; return; }
  kubectl delete rlj --all -n "$NS" --wait=true --timeout=120s || true
  helm uninstall rljob-e2e -n "$NS" || true
  kubectl delete namespace "$NS" --wait=false || true
}
trap cleanup EXIT

# 2. training-operator and S3
if [ "$SKIP_TO" = 0 ]; then
  log "installing the Kubeflow training-operator"
  kubectl apply --server-side -k "github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref=${TRAINING_OPERATOR_REF:-v1.9.2}"
  kubectl -n kubeflow rollout status deploy/training-operator --timeout="${TIMEOUT}s"
fi
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
if [ -z "${S3_ENDPOINT:-}" ]; then
  log "starting MinIO in $NS"
  kubectl -n "$NS" apply -f e2e/minio.yaml
  kubectl -n "$NS" rollout status deploy/minio --timeout="${TIMEOUT}s"
  AWS_ACCESS_KEY_ID=rljob-e2e AWS_SECRET_ACCESS_KEY=rljob-e2e-secret
  kubectl -n "$NS" run mc-mkbucket --rm -i --restart=Never --image=minio/mc:RELEASE.2025-08-13T08-35-41Z --command -- \
    sh -c "mc alias set e2e http://minio:9000 $AWS_ACCESS_KEY_ID $AWS_SECRET_ACCESS_KEY && mc mb -p e2e/rljob-e2e"
fi
kubectl -n "$NS" create secret generic rljob-e2e-s3 --from-literal=AWS_ACCESS_KEY_ID="$AWS_ACCESS_KEY_ID" \
  --from-literal=AWS_SECRET_ACCESS_KEY="$AWS_SECRET_ACCESS_KEY" --dry-run=client -o yaml | kubectl apply -f -

# 3. the chart
log "helm install rljob-e2e"
helm upgrade --install rljob-e2e charts/rljob-operator -n "$NS" --wait --timeout "${TIMEOUT}s" \
  --set image.repository="${OP_IMAGE%:*}" --set image.tag="$TAG" \
  --set worker.image.repository="${WK_IMAGE%:*}" --set worker.image.tag="$TAG"

wait_condition() {  # job condition
  local deadline=$((SECONDS + TIMEOUT))
  while [ $SECONDS -lt $deadline ]; do
    kubectl -n "$NS" get rlj "$1" --no-headers 2>/dev/null || true
    local status
    status=$(kubectl -n "$NS" get rlj "$1" -o jsonpath="{.status.conditions[?(@.type==\"$2\")].status}" 2>/dev/null || true)
    [ "$status" = "True" ] && return 0
    failed=$(kubectl -n "$NS" get rlj "$1" -o jsonpath='{.status.conditions[?(@.type=="Failed")].status}' 2>/dev/null || true)
    [ "$failed" = "True" ] && { kubectl -n "$NS" describe rlj "$1"; return 1; }
    sleep 10
  done
  echo "timed out waiting for $1 to be $2" >&2; kubectl -n "$NS" describe rlj "$1"; return 1
}

# 4-5. a full run
log "applying e2e/quickstart-s3.yaml"
kubectl -n "$NS" apply -f e2e/quickstart-s3.yaml
wait_condition e2e-quickstart Succeeded
step=$(kubectl -n "$NS" get rlj e2e-quickstart -o jsonpath='{.status.trainer.step}')
reward=$(kubectl -n "$NS" get rlj e2e-quickstart -o jsonpath='{.status.trainer.rewardMean}')
ckpt=$(kubectl -n "$NS" get rlj e2e-quickstart -o jsonpath='{.status.trainer.lastCheckpoint.uri}')
log "status: step=$step reward=$reward checkpoint=$ckpt"
[ "$step" = 30 ] || { echo "expected step 30, got $step" >&2; exit 1; }
python3 -c "import sys; sys.exit(0 if float('$reward') > 0.8 else 1)" || { echo "reward $reward did not rise" >&2; exit 1; }
kubectl -n "$NS" run mc-check --rm -i --restart=Never --image=minio/mc:RELEASE.2025-08-13T08-35-41Z --command -- \
  sh -c "mc alias set e2e http://minio:9000 $AWS_ACCESS_KEY_ID $AWS_SECRET_ACCESS_KEY >/dev/null && mc stat e2e/${ckpt#s3://}/COMMIT"

# 6. suspend / resume
log "suspend/resume"
sed 's/name: e2e-quickstart/name: e2e-suspend/; s/totalTrainingSteps: 30/totalTrainingSteps: 200/' e2e/quickstart-s3.yaml \
  | kubectl -n "$NS" apply -f -
wait_condition e2e-suspend Running
sleep 30
kubectl -n "$NS" patch rlj e2e-suspend --type merge -p '{"spec":{"suspend":true}}'
wait_condition e2e-suspend Suspended
pods=$(kubectl -n "$NS" get pods -l training.kubeflow.org/job-name=e2e-suspend --no-headers 2>/dev/null | wc -l)
[ "$pods" = 0 ] || { echo "pods still present after suspend" >&2; exit 1; }
kubectl -n "$NS" patch rlj e2e-suspend --type merge -p '{"spec":{"suspend":false}}'
wait_condition e2e-suspend Succeeded

# 7. the JobSet child (--jobset): 2 pods rendezvous at <job>-trainer-0-0.<job> with PET_NODE_RANK from
#    the Job completion index, then suspend/resume through the JobSet's spec.suspend.
if [ "$JOBSET" = 1 ]; then
  log "installing JobSet ${JOBSET_VERSION:-v0.8.1}"
  kubectl apply --server-side -f "https://github.com/kubernetes-sigs/jobset/releases/download/${JOBSET_VERSION:-v0.8.1}/manifests.yaml"
  kubectl -n jobset-system rollout status deploy/jobset-controller-manager --timeout="${TIMEOUT}s"
  sed 's/name: e2e-quickstart/name: e2e-jobset/; s/^spec:/spec:\n  childKind: JobSet/; s/nnodes: 1/nnodes: 2/; s/totalTrainingSteps: 30/totalTrainingSteps: 200/' \
    e2e/quickstart-s3.yaml | kubectl -n "$NS" apply -f -
  wait_condition e2e-jobset Running
  [ "$(kubectl -n "$NS" get jobset e2e-jobset -o jsonpath='{.spec.replicatedJobs[0].template.spec.completions}')" = 2 ]
  sleep 30
  kubectl -n "$NS" patch rlj e2e-jobset --type merge -p '{"spec":{"suspend":true}}'
  wait_condition e2e-jobset Suspended
  kubectl -n "$NS" patch rlj e2e-jobset --type merge -p '{"spec":{"suspend":false}}'
  wait_condition e2e-jobset Succeeded
fi
log "PASSED"
