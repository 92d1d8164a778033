{{/*
Names, labels and the pod pieces every component shares.

Pods carry app.kubernetes.io/{name,instance,component} (the selector labels) and, for the
gateway, prefill and decode pods, pdserve.ai/role: the label NetworkPolicies, PDBs and
anti-affinity rules select on.
*/}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
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

{{/* "<fullname>-<component>": args (root, component) */}}
{{- define "pdserve.componentName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" (index . 0)) (index . 1) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: args (root, component) */}}
{{- define "pdserve.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "pdserve.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* All labels of one component's objects: args (root, component) */}}
{{- define "pdserve.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "pdserve.chart" $root }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The URL every component connects to. */}}
{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.bundled }}
{{- printf "redis://%s.%s.svc:%d/0" (include "pdserve.componentName" (list . "redis")) .Release.Namespace (int .Values.redis.port) }}
{{- else }}
{{- required "redis.externalUrl is required when redis.bundled is false" .Values.redis.externalUrl }}
{{- end }}
{{- end }}

{{/* The Secret holding the Redis password ("" when auth is off). */}}
{{- define "pdserve.redisSecretName" -}}
{{- if .Values.redis.auth.enabled }}
{{- default (include "pdserve.componentName" (list . "redis")) .Values.redis.auth.existingSecret }}
{{- end }}
{{- end }}

{{- define "pdserve.redisTlsDir" -}}/etc/pdserve/redis-tls{{- end }}

{{/* --redis-* flags, one per line as YAML list items. */}}
{{- define "pdserve.redisArgs" -}}
- --redis-url
- {{ include "pdserve.redisUrl" . | quote }}
- --redis-namespace
- {{ .Values.redis.keyNamespace | quote }}
{{- if .Values.redis.tls.enabled }}
- --redis-tls-ca
- {{ printf "%s/ca.crt" (include "pdserve.redisTlsDir" .) | quote }}
{{- if .Values.redis.tls.clientCert }}
- --redis-tls-cert
- {{ printf "%s/tls.crt" (include "pdserve.redisTlsDir" .) | quote }}
- --redis-tls-key
- {{ printf "%s/tls.key" (include "pdserve.redisTlsDir" .) | quote }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.tlsDir" -}}/etc/pdserve/tls{{- end }}

{{/* The name expected in the workers' certificate: tls.serverName, else the gateway Service's. */}}
{{- define "pdserve.tlsServerName" -}}
{{- default (printf "%s.%s.svc" (include "pdserve.componentName" (list . "gateway")) .Release.Namespace) .Values.tls.serverName }}
{{- end }}

{{/*
--tls-* flags (tls.enabled), one per line as YAML list items: args (root, component). The same
files and server name for every process; --tls-client-auth exists on the gateway only.
*/}}
{{- define "pdserve.tlsArgs" -}}
{{- $root := index . 0 }}
{{- $name := index . 1 }}
{{- if $root.Values.tls.enabled }}
{{- $dir := include "pdserve.tlsDir" $root }}
- --tls-cert
- {{ printf "%s/tls.crt" $dir | quote }}
- --tls-key
- {{ printf "%s/tls.key" $dir | quote }}
- --tls-ca
- {{ printf "%s/ca.crt" $dir | quote }}
- --tls-server-name
- {{ include "pdserve.tlsServerName" $root | quote }}
{{- if and (eq $name "gateway") $root.Values.tls.gatewayClientAuth }}
- --tls-client-auth
{{- end }}
{{- end }}
{{- end }}

{{/* --model, when the values name one. */}}
{{- define "pdserve.modelArgs" -}}
{{- if .Values.model.path }}
- --model
- {{ .Values.model.path | quote }}
{{- end }}
{{- end }}

{{/*
Checks that fail the render with a message instead of producing a broken release:
args (root, component).
*/}}
{{- define "pdserve.checkComponent" -}}
{{- $root := index . 0 }}
{{- $name := index . 1 }}
{{- $c := index $root.Values $name }}
{{- $minPeriod := add (ceil $c.grace) 5 }}
{{- if lt (float64 $c.terminationGracePeriodSeconds) (float64 $minPeriod) }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%v) must be at least %s.grace + 5 (%v): the pod is killed before it has drained" $name $c.terminationGracePeriodSeconds $name $minPeriod) }}
{{- end }}
{{- if and $c.autoscaling.enabled $c.autoscaling.targetCPUUtilizationPercentage }}
{{- if not (and $c.resources $c.resources.requests $c.resources.requests.cpu) }}
{{- fail (printf "%s.autoscaling.targetCPUUtilizationPercentage needs %s.resources.requests.cpu" $name $name) }}
{{- end }}
{{- end }}
{{- if and $c.autoscaling.enabled (not $c.autoscaling.targetCPUUtilizationPercentage) (not $c.autoscaling.metrics) }}
{{- fail (printf "%s.autoscaling is enabled without a metric: set targetCPUUtilizationPercentage or metrics" $name) }}
{{- end }}
{{- if and $c.autoscaling.enabled (gt (int $c.autoscaling.minReplicas) (int $c.autoscaling.maxReplicas)) }}
{{- fail (printf "%s.autoscaling.minReplicas is above maxReplicas" $name) }}
{{- end }}
{{- end }}

{{- define "pdserve.checkGlobal" -}}
{{- if and .Values.redis.bundled .Values.redis.tls.enabled }}
{{- fail "redis.tls is for an external Redis (redis.bundled: false): the bundled Redis serves plain TCP inside the cluster" }}
{{- end }}
{{- if and .Values.redis.tls.enabled (not .Values.redis.tls.secretName) }}
{{- fail "redis.tls.enabled needs redis.tls.secretName" }}
{{- end }}
{{- if and .Values.model.pvc.claimName (not .Values.model.path) }}
{{- fail "model.pvc.claimName needs model.path: the GGUF file or HF folder inside the volume" }}
{{- end }}
{{- if and .Values.redis.auth.enabled (not .Values.redis.auth.existingSecret) (not .Values.redis.auth.password) }}
{{- fail "redis.auth.enabled needs redis.auth.password or redis.auth.existingSecret" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) }}
{{- fail "tls.enabled needs tls.existingSecret: the Secret holding the certificate, its key and the CA (tls.crt, tls.key, ca.crt, as cert-manager writes them)" }}
{{- end }}
{{- if and .Values.tls.gatewayClientAuth (not .Values.tls.enabled) }}
{{- fail "tls.gatewayClientAuth needs tls.enabled" }}
{{- end }}
{{- end }}

{{/*
Resources with the GPU count written to both requests and limits (extended resources must be
equal in both): args (root, component values).
*/}}
{{- define "pdserve.resources" -}}
{{- $root := index . 0 }}
{{- $c := index . 1 }}
{{- $res := deepCopy (default dict $c.resources) }}
{{- if gt (int (default 0 $c.gpus)) 0 }}
{{- $count := toString (int $c.gpus) }}
{{- /* merge writes into its first argument: a fresh dict for each. */}}
{{- $_ := set $res "requests" (merge (dict $root.Values.gpuResourceName $count) (default dict $res.requests)) }}
{{- $_ := set $res "limits" (merge (dict $root.Values.gpuResourceName $count) (default dict $res.limits)) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/*
The exec probe that replaces an HTTPS httpGet probe when the gateway requires client
certificates (tls.gatewayClientAuth; the kubelet cannot present one): the same GET from inside
the pod with its own certificate, success on 200-399 as for httpGet. Python's standard library
only (the image's python). args: root, port (number), path, timeout (seconds).
*/}}
{{- define "pdserve.httpsExecProbe" -}}
{{- $dir := printf "%s/" (include "pdserve.tlsDir" .root) -}}
command:
  - python
  - -c
  - {{ printf "import http.client,ssl,sys;d=%q;c=ssl.create_default_context(cafile=d+\"ca.crt\");c.check_hostname=False;c.load_cert_chain(d+\"tls.crt\",d+\"tls.key\");h=http.client.HTTPSConnection(\"127.0.0.1\",int(sys.argv[1]),context=c,timeout=float(sys.argv[3]));h.request(\"GET\",sys.argv[2]);sys.exit(0 if 200<=h.getresponse().status<400 else 1)" $dir | quote }}
  - {{ .port | int | quote }}
  - {{ .path | quote }}
  - {{ .timeout | int | quote }}
{{- end }}

{{/*
A probe from values: args dict root, name (component), probe, grpcPort.
Without TLS, a probe without a handler checks gRPC health on grpcPort. With tls.enabled the
kubelet's gRPC probes cannot connect (they speak plaintext), so:
  - a grpc handler fails the render;
  - without a handler, the gateway fetches /health on its HTTP port (the status its gRPC health
    reports) and a worker opens a TCP connection to its gRPC port (bound once the model has
    loaded; the health it replaces is SERVING from then until shutdown);
  - the gateway's httpGet probes use HTTPS; with tls.gatewayClientAuth they become exec probes
    (pdserve.httpsExecProbe). Worker httpGet probes stay HTTP (the metrics port is plaintext).
*/}}
{{- define "pdserve.probe" -}}
{{- $root := .root }}
{{- $name := .name }}
{{- $tls := $root.Values.tls }}
{{- $probe := deepCopy .probe }}
{{- $hasHandler := or $probe.grpc $probe.httpGet $probe.tcpSocket $probe.exec }}
{{- if not $tls.enabled }}
{{- if not $hasHandler }}
{{- $_ := set $probe "grpc" (dict "port" (int .grpcPort)) }}
{{- end }}
{{- else }}
{{- if $probe.grpc }}
{{- fail (printf "%s.%s: gRPC probes cannot do TLS (tls.enabled); leave the handler out for a TLS-compatible one, or use tcpSocket or exec" $name .kind) }}
{{- end }}
{{- if not $hasHandler }}
{{- if eq $name "gateway" }}
{{- $_ := set $probe "httpGet" (dict "path" "/health" "port" "http") }}
{{- else }}
{{- $_ := set $probe "tcpSocket" (dict "port" "grpc") }}
{{- end }}
{{- end }}
{{- if and $probe.httpGet (eq $name "gateway") }}
{{- if $tls.gatewayClientAuth }}
{{- $port := $probe.httpGet.port }}
{{- if kindIs "string" $port }}
{{- if ne $port "http" }}
{{- fail (printf "gateway.%s: httpGet port %q is not the gateway's HTTP port" .kind $port) }}
{{- end }}
{{- $port = $root.Values.gateway.ports.http }}
{{- end }}
{{- $exec := include "pdserve.httpsExecProbe" (dict "root" $root "port" $port "path" (default "/" $probe.httpGet.path) "timeout" (default 1 $probe.timeoutSeconds)) | fromYaml }}
{{- $_ := unset $probe "httpGet" }}
{{- $_ := set $probe "exec" $exec }}
{{- else }}
{{- $_ := set $probe.httpGet "scheme" "HTTPS" }}
{{- end }}
{{- end }}
{{- end }}
{{- toYaml $probe }}
{{- end }}

{{/*
The pod spec shared by the gateway, prefill and decode Deployments.
args: dict root, name (component), args (rendered YAML list), ports (list of dicts name/port),
grpcPort, isWorker (adds /dev/shm).
*/}}
{{- define "pdserve.podTemplate" -}}
{{- $root := .root }}
{{- $name := .name }}
{{- $c := index $root.Values $name -}}
metadata:
  labels:
    {{- include "pdserve.selectorLabels" (list $root $name) | nindent 4 }}
    pdserve.ai/role: {{ $name }}
    {{- with $c.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $c.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "pdserve.serviceAccountName" $root }}
  automountServiceAccountToken: false
  # No {SERVICE}_PORT variables: a Service named "pdserve" would inject PDSERVE_PORT, which the
  # CLI reads as the default of --port.
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ int $c.terminationGracePeriodSeconds }}
  {{- with $c.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $c.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with $root.Values.image.pullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  {{- with $c.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $c.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $c.affinity }}
  affinity:
    {{- tpl (toYaml .) $root | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ $name }}
      image: {{ include "pdserve.image" $root | quote }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      args:
        {{- .args | nindent 8 }}
        {{- with $c.extraArgs }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        {{- range .ports }}
        - name: {{ .name }}
          containerPort: {{ .port }}
          protocol: TCP
        {{- end }}
      env:
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        # The root filesystem is read-only: caches (Triton, torch) go to the /tmp emptyDir.
        - name: HOME
          value: /tmp
        - name: PDSERVE_LOG_LEVEL
          value: {{ $root.Values.logLevel | quote }}
        {{- if $root.Values.redis.auth.enabled }}
        - name: PDSERVE_REDIS_PASSWORD
          valueFrom:
            secretKeyRef:
              name: {{ include "pdserve.redisSecretName" $root }}
              key: {{ $root.Values.redis.auth.passwordKey }}
        {{- end }}
        {{- if and (eq $name "gateway") $c.apiKeys.existingSecret }}
        - name: PDSERVE_API_KEYS
          valueFrom:
            secretKeyRef:
              name: {{ $c.apiKeys.existingSecret }}
              key: {{ $c.apiKeys.secretKey }}
        {{- end }}
        {{- with $c.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- range $kind := list "startupProbe" "readinessProbe" "livenessProbe" }}
      {{ $kind }}:
        {{- include "pdserve.probe" (dict "root" $root "name" $name "kind" $kind "probe" (index $c $kind) "grpcPort" $.grpcPort) | nindent 8 }}
      {{- end }}
      resources:
        {{- include "pdserve.resources" (list $root $c) | nindent 8 }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        {{- if .isWorker }}
        - name: dshm
          mountPath: /dev/shm
        {{- if $root.Values.kvOffload.disk.enabled }}
        - name: kv-offload
          mountPath: {{ include "pdserve.kvOffloadDir" $root }}
        {{- end }}
        {{- end }}
        {{- if $root.Values.model.pvc.claimName }}
        - name: model
          mountPath: {{ $root.Values.model.pvc.mountPath }}
          readOnly: true
          {{- with $root.Values.model.pvc.subPath }}
          subPath: {{ . }}
          {{- end }}
        {{- end }}
        {{- if $root.Values.redis.tls.enabled }}
        - name: redis-tls
          mountPath: {{ include "pdserve.redisTlsDir" $root }}
          readOnly: true
        {{- end }}
        {{- if $root.Values.tls.enabled }}
        - name: tls
          mountPath: {{ include "pdserve.tlsDir" $root }}
          readOnly: true
        {{- end }}
  volumes:
    - name: tmp
      emptyDir:
        sizeLimit: {{ $root.Values.tmpSizeLimit }}
    {{- if .isWorker }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $c.shmSizeLimit }}
    {{- with $root.Values.kvOffload.disk }}
    {{- if .enabled }}
    - name: kv-offload
      {{- if .hostPath }}
      hostPath:
        path: {{ .hostPath }}
        type: DirectoryOrCreate
      {{- else }}
      emptyDir:
        sizeLimit: {{ .sizeLimit }}
      {{- end }}
    {{- end }}
    {{- end }}
    {{- end }}
    {{- if $root.Values.model.pvc.claimName }}
    - name: model
      persistentVolumeClaim:
        claimName: {{ $root.Values.model.pvc.claimName }}
        readOnly: true
    {{- end }}
    {{- if $root.Values.redis.tls.enabled }}
    - name: redis-tls
      secret:
        secretName: {{ $root.Values.redis.tls.secretName }}
        defaultMode: 0440
        items:
          - key: {{ $root.Values.redis.tls.caKey }}
            path: ca.crt
          {{- if $root.Values.redis.tls.clientCert }}
          - key: {{ $root.Values.redis.tls.certKey }}
            path: tls.crt
          - key: {{ $root.Values.redis.tls.keyKey }}
            path: tls.key
          {{- end }}
    {{- end }}
    {{- if $root.Values.tls.enabled }}
    - name: tls
      secret:
        secretName: {{ $root.Values.tls.existingSecret }}
        defaultMode: 0440
        items:
          - key: {{ $root.Values.tls.certKey }}
            path: tls.crt
          - key: {{ $root.Values.tls.keyKey }}
            path: tls.key
          - key: {{ $root.Values.tls.caKey }}
            path: ca.crt
    {{- end }}
{{- end }}

{{/* A Deployment around pdserve.podTemplate: same args. */}}
{{- define "pdserve.deployment" -}}
{{- $root := .root }}
{{- $name := .name }}
{{- $c := index $root.Values $name }}
{{- include "pdserve.checkGlobal" $root }}
{{- include "pdserve.checkComponent" (list $root $name) -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "pdserve.componentName" (list $root $name) }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pdserve.labels" (list $root $name) | nindent 4 }}
    pdserve.ai/role: {{ $name }}
spec:
  {{- if not $c.autoscaling.enabled }}
  replicas: {{ int $c.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" (list $root $name) | nindent 6 }}
  {{- with $c.strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  template:
    {{- include "pdserve.podTemplate" . | nindent 4 }}
{{- end }}
