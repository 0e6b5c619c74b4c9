{{/* Names: <release>-duet, and <release>-duet-<component> for each object. */}}
{{- define "duet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* include "duet.componentName" (list $ "prefill") */}}
{{- define "duet.componentName" -}}
{{- printf "%s-%s" (include "duet.fullname" (index . 0)) (index . 1) -}}
{{- end -}}

{{- define "duet.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ default $root.Chart.Name $root.Values.nameOverride | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "duet.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "duet.selectorLabels" . }}
app.kubernetes.io/part-of: duet
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- end -}}

{{- define "duet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "duet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "duet.image" -}}
{{- $flavor := ternary "cuda" "cpu" .Values.gpu.enabled -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion $flavor) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* The --model argument: "" when the embedded tiny model baked into the image is used. */}}
{{- define "duet.modelDir" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "image" -}}
{{- $m.path -}}
{{- else if $m.path -}}
{{- printf "%s/%s" (trimSuffix "/" $m.mountPath) (trimPrefix "/" $m.path) -}}
{{- else -}}
{{- $m.mountPath -}}
{{- end -}}
{{- end -}}

{{- define "duet.modelClaimName" -}}
{{- if eq .Values.model.source "existingClaim" -}}
{{- .Values.model.existingClaim -}}
{{- else if eq .Values.model.source "pvc" -}}
{{- include "duet.componentName" (list . "model") -}}
{{- end -}}
{{- end -}}

{{/* Internal TLS (templates/internal-tls-secret.yaml): the Secret, and each pod's flag, mount and volume. */}}
{{- define "duet.internalTlsSecretName" -}}
{{- .Values.internalTls.existingSecret | default (include "duet.componentName" (list . "internal-tls")) -}}
{{- end -}}

{{- define "duet.internalTlsArg" -}}
{{- if .Values.internalTls.enabled }}
- --internal-tls-dir=/etc/duet/internal-tls
{{- end }}
{{- end -}}

{{- define "duet.internalTlsMount" -}}
{{- if .Values.internalTls.enabled }}
- name: internal-tls
  mountPath: /etc/duet/internal-tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "duet.internalTlsVolume" -}}
{{- if .Values.internalTls.enabled }}
- name: internal-tls
  secret:
    secretName: {{ include "duet.internalTlsSecretName" . }}
    defaultMode: 0440  # group: fsGroup 10001, the container's user
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- end -}}

{{/* Redis: the Secret holding the password ("" = no password), its key, and the URL every component gets.
     The password reaches the URL through Kubernetes' $(VAR) expansion of container args. */}}
{{- define "duet.redisSecretName" -}}
{{- $r := .Values.redis -}}
{{- if $r.internal.enabled -}}
{{- $r.internal.auth.existingSecret | default (include "duet.componentName" (list . "redis")) -}}
{{- else -}}
{{- $r.external.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "duet.redisSecretKey" -}}
{{- $r := .Values.redis -}}
{{- if $r.internal.enabled -}}
{{- ternary $r.internal.auth.existingSecretPasswordKey "password" (ne $r.internal.auth.existingSecret "") -}}
{{- else -}}
{{- $r.external.existingSecretPasswordKey -}}
{{- end -}}
{{- end -}}

{{- define "duet.redisUrl" -}}
{{- $r := .Values.redis -}}
{{- if $r.internal.enabled -}}
{{- printf "redis://:$(REDIS_PASSWORD)@%s:6379/%v" (include "duet.componentName" (list . "redis")) (int $r.internal.db) -}}
{{- else if $r.external.existingSecret -}}
{{- $u := urlParse $r.external.url -}}
{{- printf "%s://%s:$(REDIS_PASSWORD)@%s%s" $u.scheme $r.external.username $u.host $u.path -}}
{{- if $u.query }}?{{ $u.query }}{{ end -}}
{{- else -}}
{{- $r.external.url -}}
{{- end -}}
{{- end -}}

{{/* Env every duet container gets. */}}
{{- define "duet.commonEnv" -}}
- name: HOME  # the root filesystem is read-only; caches (Triton, torch) go to the /tmp emptyDir
  value: /tmp
{{- if include "duet.redisSecretName" . }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "duet.redisSecretName" . }}
      key: {{ include "duet.redisSecretKey" . }}
{{- end }}
- name: DUET_CLUSTER_SECRET  # authenticates the internal plane (templates/cluster-secret.yaml)
  valueFrom:
    secretKeyRef:
      name: {{ .Values.clusterSecret.existingSecret | default (include "duet.componentName" (list . "cluster")) }}
      key: {{ .Values.clusterSecret.existingSecretKey }}
{{- end -}}

{{- define "duet.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "duet.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* gRPC health probes (grpc.health.v1, the given service), on the container's gRPC port; a TCP check of it
     when the port serves TLS (kubelet's gRPC probe speaks no TLS). The router is probed on its
     "grpc.health.v1.Health" service, SERVING while the process is: its "" service is NOT_SERVING while no worker
     of a role is up, and a router taken out of its Service (or restarted) then would turn a worker's restart,
     which requests wait out, into refused connections.
     The startup probe gives model loading startupTimeoutSeconds: failureThreshold x periodSeconds >= it;
     liveness and readiness start only after it succeeds. The port is bound only once the model is loaded.
     include "duet.probes" (list port values tls service) */}}
{{- define "duet.probes" -}}
{{- $port := index . 0 -}}
{{- $v := index . 1 -}}
{{- $check := ternary "tcpSocket" "grpc" (index . 2) -}}
{{- $service := index . 3 -}}
{{- $period := int $v.probes.periodSeconds -}}
startupProbe:
  {{ $check }}:
    port: {{ $port }}
    {{- if and $service (eq $check "grpc") }}
    service: {{ $service }}
    {{- end }}
  periodSeconds: {{ $period }}
  timeoutSeconds: {{ $v.probes.timeoutSeconds }}
  failureThreshold: {{ div (add (int $v.startupTimeoutSeconds) (sub $period 1)) $period }}
readinessProbe:
  {{ $check }}:
    port: {{ $port }}
    {{- if and $service (eq $check "grpc") }}
    service: {{ $service }}
    {{- end }}
  periodSeconds: {{ $period }}
  timeoutSeconds: {{ $v.probes.timeoutSeconds }}
  failureThreshold: {{ $v.probes.readinessFailureThreshold }}
livenessProbe:
  {{ $check }}:
    port: {{ $port }}
    {{- if and $service (eq $check "grpc") }}
    service: {{ $service }}
    {{- end }}
  periodSeconds: {{ $period }}
  timeoutSeconds: {{ $v.probes.timeoutSeconds }}
  failureThreshold: {{ $v.probes.livenessFailureThreshold }}
{{- end -}}

{{/* A role's topologySpreadConstraints, each given this role's pods as its labelSelector and the rollout's
     pod-template-hash as matchLabelKeys where the entry names none (so old and new pods of a rolling update are
     not counted together). include "duet.topologySpread" (list $ role values) */}}
{{- define "duet.topologySpread" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
{{- $v := index . 2 -}}
{{- $out := list -}}
{{- range $v.topologySpreadConstraints -}}
{{- $c := deepCopy . -}}
{{- if not (hasKey $c "labelSelector") -}}
{{- $_ := set $c "labelSelector" (dict "matchLabels" (include "duet.selectorLabels" (list $root $role) | fromYaml)) -}}
{{- end -}}
{{- if not (hasKey $c "matchLabelKeys") -}}
{{- $_ := set $c "matchLabelKeys" (list "pod-template-hash") -}}
{{- end -}}
{{- $out = append $out $c -}}
{{- end -}}
{{- with $out -}}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* The ports a decode worker's KV receivers listen on: kvPort + rank for each tensor-parallel rank. */}}
{{- define "duet.kvPorts" -}}
{{- $v := .Values.decode -}}
{{- range $rank := until (int $v.tp) }}
- name: {{ ternary "kv" (printf "kv-rank%d" $rank) (eq $rank 0) }}
  containerPort: {{ add (int $v.kvPort) $rank }}
  protocol: TCP
{{- end -}}
{{- end -}}

{{/* Metric names behind the autoscaling choices (the workers' Prometheus names). */}}
{{- define "duet.metricName" -}}
{{- $names := dict "waitingRequests" "duet_num_requests_waiting" "waitingTokens" "duet_num_waiting_tokens" "kvCacheUsage" "duet_kv_cache_usage_perc" "runningRequests" "duet_num_requests_running" "sloTtftQueue" "duet_router_prefill_queue_seconds" -}}
{{- get $names . -}}
{{- end -}}

{{/* The pool total of one metric; the autoscaler divides it by the per-replica target. */}}
{{- define "duet.autoscalingQuery" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
{{- $metric := index . 2 -}}
{{- $selector := tpl $root.Values.autoscaling.prometheus.selector $root -}}
{{- if eq $metric "sloTtftQueue" -}}
{{- /* the routers' prediction of the pool's queue wait (each router sees the whole pool: the max, not the sum), in
       TTFT SLOs */ -}}
{{- printf "(max(duet_router_prefill_queue_seconds{%s}) or vector(0)) / %v" $selector (divf $root.Values.router.sloTtftMs 1000) -}}
{{- else -}}
{{- printf "sum(%s{role=\"%s\"%s%s}) or vector(0)" (include "duet.metricName" $metric) $role (ternary "" "," (eq $selector "")) $selector -}}
{{- end -}}
{{- end -}}
