#!/usr/bin/env bash
# Packages the Helm chart as users consume it: lint (strict), then `helm package` into out/ (KXPU_CHART_OUT):
#   out/kxpu-<chart version>.tgz
# An OCI artifact as it stands: `helm push out/kxpu-<version>.tgz oci://registry.example.com/charts` (README,
# "Mirroring"). The chart's version and appVersion must equal kxpu's (pyproject.toml): a release is one version.
#
# usage: hack/helm/package.sh   (prints the archive's path on stdout)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CHART=$REPO/deploy/helm/kxpu
OUT=${KXPU_CHART_OUT:-$REPO/out}
HELM=${KXPU_HELM:-$("$REPO/hack/helm/build.sh")}

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$REPO/pyproject.toml" | head -1)
chart_version=$(sed -n 's/^version: *//p' "$CHART/Chart.yaml")
app_version=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$CHART/Chart.yaml")
if [[ $chart_version != "$version" || $app_version != "$version" ]]; then
  echo "hack/helm/package.sh: Chart.yaml has version $chart_version, appVersion $app_version; kxpu is $version" \
    "(pyproject.toml): set both to $version" >&2
  exit 1
fi
"$HELM" lint --strict "$CHART" >/dev/null
mkdir -p "$OUT"
"$HELM" package "$CHART" --destination "$OUT" >/dev/null
echo "$OUT/kxpu-$version.tgz"
