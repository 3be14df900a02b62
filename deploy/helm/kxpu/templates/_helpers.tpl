{{/* Names are cut to 63 characters: DNS labels and label values allow no more. */}}
{{- define "kxpu.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kxpu.fullname" -}}
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

{{- define "kxpu.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kxpu.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kxpu.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kxpu.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kxpu.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- /* The node daemon's ServiceAccount. Its roles (and the admission policy that scopes them to a node) go to this
account: never the namespace's "default", which every pod of the namespace may run as. */}}
{{- define "kxpu.plugin.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-plugin" (include "kxpu.fullname" .) | trunc 63 | trimSuffix "-") .Values.serviceAccount.name }}
{{- else if or (not .Values.serviceAccount.name) (eq .Values.serviceAccount.name "default") }}
{{- fail "serviceAccount.create: false needs serviceAccount.name: an existing ServiceAccount for the node daemon alone (not the namespace's \"default\", which every pod there may run as and which would get the daemon's roles)" }}
{{- else }}
{{- .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- /* kube-scheduler's image: by digest when one is set (sha256:...), else by tag; no tag: the cluster's version
(vMAJOR.MINOR.PATCH, without a provider's suffix, which registry.k8s.io does not tag). */}}
{{- define "kxpu.kubeScheduler.image" -}}
{{- $image := .Values.scheduler.kubeScheduler.image }}
{{- if $image.digest }}
{{- if not (regexMatch "^sha256:[0-9a-f]{64}$" $image.digest) }}
{{- fail (printf "scheduler.kubeScheduler.image.digest: %q is not sha256:<64 hex digits>" $image.digest) }}
{{- end }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- $v := semver .Capabilities.KubeVersion.Version }}
{{- printf "%s:%s" $image.repository (default (printf "v%d.%d.%d" $v.Major $v.Minor $v.Patch) $image.tag) }}
{{- end }}
{{- end }}

{{- /* "true" when the node daemon talks to the API server (sharing, or a resource served through DRA): it then gets
a token, roles, and the ValidatingAdmissionPolicy that keeps every write of its to its own node. */}}
{{- define "kxpu.plugin.apiAccess" -}}
{{- if or .Values.sharing.enabled (include "kxpu.dra.enabled" .) }}true{{ end }}
{{- end }}

{{- /* The backends that open device nodes (vendor libraries: NVML, DCMI, CNDev, HLML): their DaemonSets must be
privileged with plugin.privileged: auto (values.yaml says why, per backend). */}}
{{- define "kxpu.plugin.deviceBackends" -}}
{{- toYaml (list "nvidia" "ascend" "cambricon" "gaudi") }}
{{- end }}

{{- /* "true" when the DaemonSet running node config `.config` must be privileged (plugin.privileged). */}}
{{- define "kxpu.plugin.privileged" -}}
{{- $mode := toString .root.Values.plugin.privileged }}
{{- if eq $mode "true" }}true
{{- else if eq $mode "auto" }}
{{- $needs := false }}
{{- $backends := include "kxpu.plugin.deviceBackends" .root | fromYamlArray }}
{{- range $r := (get .config "resources" | default list) }}
{{- range $b := $backends }}
{{- if and (kindIs "map" $r) (hasKey $r $b) }}{{ $needs = true }}{{ end }}
{{- end }}
{{- end }}
{{- if $needs }}true{{ end }}
{{- else if ne $mode "false" }}
{{- fail (printf "plugin.privileged: %q is not auto, true or false" $mode) }}
{{- end }}
{{- end }}

{{- define "kxpu.configMapName" -}}
{{- printf "%s-config" (include "kxpu.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The node configs as a list of {name, key, config}: "default" (from .Values.config) first, then
.Values.nodeConfigs by name. Each becomes a ConfigMap key and a DaemonSet. Returned as YAML.
*/}}
{{- define "kxpu.nodeConfigs" -}}
{{- $out := list (dict "name" "default" "key" "config.yaml" "config" (deepCopy .Values.config)) }}
{{- range $name := keys .Values.nodeConfigs | sortAlpha }}
{{- if or (eq $name "default") (not (regexMatch "^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$" $name)) }}
{{- fail (printf "nodeConfigs.%s: a name must be lowercase letters, digits and '-', at most 40 characters (it is a label value and part of a DaemonSet name), and not \"default\"" $name) }}
{{- end }}
{{- $out = append $out (dict "name" $name "key" (printf "%s.yaml" $name) "config" (deepCopy (get $.Values.nodeConfigs $name))) }}
{{- end }}
{{- if .Values.sharing.enabled }}
{{- /* Resources that share devices verify assignments with the release's keys unless they name some, and find
the lock Leases in the release namespace. */}}
{{- $keys := include "kxpu.sharing.nodeKeys" . | fromYamlArray }}
{{- range $out }}
{{- if kindIs "map" .config }}
{{- range (get .config "resources" | default list) }}
{{- if and (kindIs "map" .) (kindIs "map" (get . "sharing")) }}
{{- $sharing := get . "sharing" }}
{{- if not (hasKey $sharing "signingKey") }}
{{- $_ := set $sharing "signingKey" (first $keys) }}
{{- $_ := set $sharing "extraKeys" (rest $keys) }}
{{- end }}
{{- if not (hasKey $sharing "lockNamespace") }}
{{- $_ := set $sharing "lockNamespace" $.Release.Namespace }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- /* plugin.devicePluginHandover: every node config that names no devicePluginHandover gets it. */}}
{{- $handover := toString (.Values.plugin.devicePluginHandover | default "auto") }}
{{- if not (has $handover (list "auto" "alongside" "standby")) }}
{{- fail (printf "plugin.devicePluginHandover: %q is not auto, alongside or standby" $handover) }}
{{- end }}
{{- if eq $handover "auto" }}
{{- $handover = ternary "alongside" "standby" (semverCompare ">=1.37.0-0" .Capabilities.KubeVersion.Version) }}
{{- end }}
{{- range $out }}
{{- if and (kindIs "map" .config) (not (hasKey .config "devicePluginHandover")) }}
{{- $_ := set .config "devicePluginHandover" $handover }}
{{- end }}
{{- end }}
{{- /* dra.taints: the taint effect per fault class for every resource served through DRA that names none. */}}
{{- if .Values.dra.taints }}
{{- range $out }}
{{- if kindIs "map" .config }}
{{- range (get .config "resources" | default list) }}
{{- if and (kindIs "map" .) (eq (toString (get . "serve")) "dra") }}
{{- if not (kindIs "map" (get . "dra")) }}
{{- $_ := set . "dra" dict }}
{{- end }}
{{- if not (hasKey (get . "dra") "taints") }}
{{- $_ := set (get . "dra") "taints" (deepCopy $.Values.dra.taints) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- range $out }}
{{- $where := ternary "config" (printf "nodeConfigs.%s" .name) (eq .name "default") }}
{{- if not (kindIs "map" .config) }}
{{- fail (printf "%s must be a kxpu config mapping (version, resources)" $where) }}
{{- end }}
{{- if ne (toString (get .config "version")) "v1" }}
{{- fail (printf "%s.version must be v1" $where) }}
{{- end }}
{{- if not (get .config "resources") }}
{{- fail (printf "%s.resources must list at least one resource" $where) }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{- /* Sharing: names of the control plane's objects. */}}
{{- define "kxpu.sharing.keySecret" -}}
{{- default (printf "%s-signing-key" (include "kxpu.fullname" .) | trunc 63 | trimSuffix "-") .Values.sharing.signingKey.secretName }}
{{- end }}

{{- define "kxpu.sharing.ed25519Secret" -}}
{{- default (printf "%s-signing-ed25519" (include "kxpu.fullname" .) | trunc 63 | trimSuffix "-") .Values.sharing.signing.ed25519Key.secretName }}
{{- end }}

{{- define "kxpu.sharing.verifyKeys" -}}
{{- printf "%s-verify-keys" (include "kxpu.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- /* The signing schemes named by sharing.signing.scheme, in order (the first signs). */}}
{{- define "kxpu.sharing.schemes" -}}
{{- $schemes := splitList "+" .Values.sharing.signing.scheme }}
{{- range $schemes }}
{{- if not (has . (list "ed25519" "hmac")) }}
{{- fail (printf "sharing.signing.scheme: %q is not ed25519, hmac, hmac+ed25519 or ed25519+hmac" $.Values.sharing.signing.scheme) }}
{{- end }}
{{- end }}
{{- if or (gt (len $schemes) 2) (ne (len $schemes) (len (uniq $schemes))) }}
{{- fail (printf "sharing.signing.scheme: %q is not ed25519, hmac, hmac+ed25519 or ed25519+hmac" .Values.sharing.signing.scheme) }}
{{- end }}
{{- toYaml $schemes }}
{{- end }}

{{- /* The schemes the nodes accept: all named, less hmac once nodesAcceptHmac is false. */}}
{{- define "kxpu.sharing.nodeSchemes" -}}
{{- $out := list }}
{{- range include "kxpu.sharing.schemes" . | fromYamlArray }}
{{- if or (ne . "hmac") $.Values.sharing.signing.nodesAcceptHmac }}
{{- $out = append $out . }}
{{- end }}
{{- end }}
{{- if not $out }}
{{- fail "sharing.signing.nodesAcceptHmac: false leaves the nodes no key to verify with (scheme hmac): switch to ed25519 first" }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{- /* Key sources of the node daemons (public keys and, while accepted, the HMAC Secret) and of the extender. */}}
{{- define "kxpu.sharing.nodeKeys" -}}
{{- $out := list }}
{{- range include "kxpu.sharing.nodeSchemes" . | fromYamlArray }}
{{- if eq . "hmac" }}
{{- $out = append $out (dict "secret" (printf "%s/%s" $.Release.Namespace (include "kxpu.sharing.keySecret" $)) "field" $.Values.sharing.signingKey.field "hmac" true) }}
{{- else }}
{{- $out = append $out (dict "configMap" (printf "%s/%s" $.Release.Namespace (include "kxpu.sharing.verifyKeys" $)) "field" "keys") }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{- /* The extender reads its keys through the API; with create it makes a missing Secret itself on first start, so
no key is ever in the chart's output (a re-render keeps it) or in a Helm release revision. */}}
{{- define "kxpu.sharing.extenderKeys" -}}
{{- $out := list }}
{{- range include "kxpu.sharing.schemes" . | fromYamlArray }}
{{- if eq . "hmac" }}
{{- $out = append $out (dict "secret" (printf "%s/%s" $.Release.Namespace (include "kxpu.sharing.keySecret" $)) "field" $.Values.sharing.signingKey.field "hmac" true "generate" $.Values.sharing.signingKey.create) }}
{{- else }}
{{- $out = append $out (dict "secret" (printf "%s/%s" $.Release.Namespace (include "kxpu.sharing.ed25519Secret" $)) "field" $.Values.sharing.signing.ed25519Key.field "generate" $.Values.sharing.signing.ed25519Key.create) }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{- define "kxpu.sharing.configMapName" -}}
{{- printf "%s-sharing" (include "kxpu.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kxpu.scheduler.name" -}}
{{- printf "%s-scheduler" (include "kxpu.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kxpu.webhook.name" -}}
{{- printf "%s-webhook" (include "kxpu.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kxpu.webhook.tlsSecret" -}}
{{- if .Values.webhook.certManager.enabled }}
{{- printf "%s-tls" (include "kxpu.webhook.name" .) }}
{{- else }}
{{- required "sharing.enabled needs webhook.tls.secretName (a kubernetes.io/tls Secret) or webhook.certManager.enabled" .Values.webhook.tls.secretName }}
{{- end }}
{{- end }}

{{- /* The accounts that may change kxpu's pod annotations and label: the extender's (and extraTrustedUsers). */}}
{{- define "kxpu.sharing.trustedUsers" -}}
{{- $users := list (printf "system:serviceaccount:%s:%s" .Release.Namespace (include "kxpu.scheduler.name" .)) }}
{{- toYaml (concat $users .Values.sharing.extraTrustedUsers) }}
{{- end }}

{{- /* The node daemon's account: the webhook lets it only set the allocated mark on pods bound to its node. */}}
{{- define "kxpu.sharing.nodeUsers" -}}
{{- toYaml (list (printf "system:serviceaccount:%s:%s" .Release.Namespace (include "kxpu.plugin.serviceAccountName" .))) }}
{{- end }}

{{- /*
DRA: the drivers the node configs serve (`serve: dra`), as a YAML list of {resource, driver}; the driver name is
dra.driverName or the resource name turned around as kxpu derives it (example.com/npu -> npu.example.com).
*/}}
{{- define "kxpu.dra.drivers" -}}
{{- $drivers := list }}
{{- $seen := dict }}
{{- range (include "kxpu.nodeConfigs" . | fromYamlArray) }}
{{- range (get .config "resources" | default list) }}
{{- if and (kindIs "map" .) (eq (toString (get . "serve")) "dra") }}
{{- $parts := splitList "/" (toString .name) }}
{{- $derived := printf "%s.%s" (regexReplaceAll "[^a-z0-9-]+" (lower (last $parts)) "-" | trimAll "-") (first $parts) }}
{{- $driver := (get . "dra" | default dict).driverName | default $derived }}
{{- if not (hasKey $seen $driver) }}
{{- $_ := set $seen $driver true }}
{{- $status := get (get . "dra" | default dict) "claimStatus" }}
{{- $drivers = append $drivers (dict "resource" .name "driver" $driver "claimStatus" (ne (toString $status) "false")) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- /* Drivers no resource serves through DRA any more whose prepared claims the daemon still drains
(dra.drainingDrivers): they keep the mounts, the API access and their slices' place in the node policy. */}}
{{- range (.Values.dra.drainingDrivers | default list) }}
{{- if not (hasKey $seen .) }}
{{- $_ := set $seen . true }}
{{- $drivers = append $drivers (dict "resource" "" "driver" . "draining" true "claimStatus" true) }}
{{- end }}
{{- end }}
{{- toYaml $drivers }}
{{- end }}

{{- /* "true" when any node config serves a resource through DRA (the daemon then needs the API). */}}
{{- define "kxpu.dra.enabled" -}}
{{- if (include "kxpu.dra.drivers" . | fromYamlArray) }}true{{ end }}
{{- end }}
