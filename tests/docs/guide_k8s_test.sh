#!/usr/bin/env bash
# guide_k8s: the ```sh block of docs/guide.md's "Running on Kubernetes", run as far as a machine
# without a cluster allows: `tessera credentials` for real, `kubectl create secret` as a client
# dry run, `kubectl apply -k DIR` as `kubectl kustomize DIR`; `kubectl wait` needs a cluster and
# is the one line not run. Then checks what those made: the credentials the Secret carries and
# the rendered overlay's objects.
#
#   guide_k8s_test.sh SOURCE_DIR BIN_DIR        (exit 77: kubectl is missing)
set -euo pipefail
src=$(cd "$1" && pwd) bin=$(cd "$2" && pwd)
command -v kubectl >/dev/null || { echo "guide_k8s: skipped: kubectl is not installed (Debian 12 has no package for it; install a release from kubernetes.io, deploy/README.md)"; exit 77; }

block=$(awk '/^## Running on Kubernetes/{s=1} s && /^```sh$/{b=1; next} b && /^```$/{exit} b' "$src/docs/guide.md")
[ -n "$block" ] || { echo "guide_k8s: docs/guide.md has no \`\`\`sh block under '## Running on Kubernetes'"; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
script=""
ran=0
while IFS= read -r line; do
  case "$line" in
    "kubectl "*" wait "*) continue ;;
    "kubectl "*"create secret "*) line="$line --dry-run=client -o yaml > secret.yaml" ;;
    "kubectl "*"apply -k "*) line="kubectl kustomize \"$src/${line##*apply -k }\" > rendered.yaml" ;;
    "build/bin/"*) prog=${line%% *}; line="\"$bin/${prog#build/bin/}\" ${line#* }" ;;
  esac
  script+="$line"$'\n'
  ran=$((ran + 1))
done <<< "$block"
[ "$ran" -ge 4 ] || { echo "guide_k8s: only $ran lines to run; the block changed shape"; exit 1; }
echo "guide_k8s: running, in $work:"; echo "$script"
(cd "$work" && bash -euo pipefail -c "$script")

fail() { echo "guide_k8s: $*"; exit 1; }
for f in ca.pem client.token admin.token cluster.token; do
  [ -s "$work/tessera-credentials/$f" ] || fail "tessera credentials made no $f"
  grep -q "^  $f: " "$work/secret.yaml" || fail "the Secret does not carry $f"
done
grep -q "^  name: tessera-credentials$" "$work/secret.yaml" || fail "the Secret is not named tessera-credentials"
# The certificate names the workers' DNS names in the namespace the block chose.
openssl x509 -in "$work/tessera-credentials/daemon.pem" -noout -text 2>/dev/null | grep -q "DNS:\*.tessera-workers.default.svc.cluster.local" ||
  fail "the daemon certificate does not name *.tessera-workers.default.svc.cluster.local"
for kind in "kind: StatefulSet" "kind: Deployment" "kind: Service"; do
  grep -q "^$kind$" "$work/rendered.yaml" || fail "the rendered overlay has no '$kind'"
done
grep -q "secretName: tessera-credentials" "$work/rendered.yaml" || fail "the rendered pods do not mount tessera-credentials"
echo "guide_k8s: ok"
