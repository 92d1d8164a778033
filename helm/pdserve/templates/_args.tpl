{{/*
The command lines (the image's ENTRYPOINT is `pdserve`), as YAML list items. Numbers go
through `int` or `toString` so that large values never render as 1e+06.
*/}}

{{- define "pdserve.gatewayArgs" -}}
{{- $v := .Values.gateway -}}
- gateway
- --host
- 0.0.0.0
- --port
- {{ $v.ports.grpc | int | quote }}
- --http-port
- {{ $v.ports.http | int | quote }}
{{ include "pdserve.redisArgs" . }}
- --lease-ttl
- {{ $v.leaseTtl | toString | quote }}
- --max-waiting
- {{ $v.maxWaiting | int | quote }}
- --max-queue-wait
- {{ $v.maxQueueWait | toString | quote }}
- --prefill-policy
- {{ $v.prefillPolicy | quote }}
- --local-prefill-max-tokens
- {{ $v.localPrefillMaxTokens | int | quote }}
- --api-servers
- {{ $v.apiServers | default 1 | int | quote }}
- --canary-idle-s
- {{ $v.canary.idleS | toString | quote }}
- --canary-timeout-s
- {{ $v.canary.timeoutS | toString | quote }}
- --canary-failures
- {{ $v.canary.failures | int | quote }}
- --grace
- {{ $v.grace | toString | quote }}
{{- include "pdserve.tlsArgs" (list . "gateway") }}
{{- include "pdserve.tracingArgs" . }}
{{- include "pdserve.modelArgs" . }}
{{- end }}

{{/* `pdserve prefill` or `pdserve decode`: args (root, component). */}}
{{- define "pdserve.workerArgs" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $v := index $root.Values $name -}}
- {{ $name }}
- --host
- 0.0.0.0
- --port
- {{ $v.ports.grpc | int | quote }}
- --advertise-host
- $(POD_IP)
- --metrics-port
- {{ $v.ports.metrics | int | quote }}
{{ include "pdserve.redisArgs" $root }}
- --worker-id
- $(POD_NAME)
{{- include "pdserve.tlsArgs" (list $root $name) }}
{{- include "pdserve.tracingArgs" $root }}
{{- if eq $name "decode" }}
- --transports
- {{ join "," $v.transports | quote }}
{{- with $v.speculative.method }}
- --speculative
- {{ . }}
- --num-speculative-tokens
- {{ $v.speculative.numSpeculativeTokens | int | quote }}
{{- end }}
{{- end }}
{{- include "pdserve.modelArgs" $root }}
{{- with $root.Values.model.dtype }}
- --dtype
- {{ . }}
{{- end }}
{{- with $v.engine.kvCacheMemoryGb }}
- --kv-cache-memory-gb
- {{ . | toString | quote }}
{{- end }}
{{- with $v.engine.maxNumSeqs }}
- --max-num-seqs
- {{ . | int | quote }}
{{- end }}
{{- with $v.engine.maxNumBatchedTokens }}
- --max-num-batched-tokens
- {{ . | int | quote }}
{{- end }}
{{- include "pdserve.kvOffloadArgs" $root }}
- --grace
- {{ $v.grace | toString | quote }}
{{- end }}

{{/* --kv-offload-* on the workers: the tiers of kvOffload (the disk tier on its volume). */}}
{{- define "pdserve.kvOffloadArgs" -}}
{{- $o := .Values.kvOffload -}}
{{- if $o.cpuGb }}
- --kv-offload-cpu-gb
- {{ $o.cpuGb | toString | quote }}
{{- end }}
{{- if $o.disk.enabled }}
- --kv-offload-dir
- {{ include "pdserve.kvOffloadDir" . | quote }}
- --kv-offload-disk-gb
- {{ $o.disk.gb | toString | quote }}
{{- end }}
{{- if $o.redis.enabled }}
{{- if and (not $o.redis.url) .Values.redis.auth.enabled }}
{{- fail "kvOffload.redis: the chart's Redis requires a password; give kvOffload.redis.url with its credentials (redis://:PASSWORD@HOST:PORT)" }}
{{- end }}
- --kv-offload-redis-url
- {{ $o.redis.url | default (include "pdserve.redisUrl" .) | quote }}
- --kv-offload-redis-gb
- {{ $o.redis.gb | toString | quote }}
{{- end }}
{{- end }}

{{- define "pdserve.kvOffloadDir" -}}/var/cache/pdserve-kv{{- end }}

{{/* --otlp-traces-endpoint on every component when tracing.otlpTracesEndpoint is set. */}}
{{- define "pdserve.tracingArgs" -}}
{{- with .Values.tracing.otlpTracesEndpoint }}
- --otlp-traces-endpoint
- {{ . | quote }}
{{- end }}
{{- end }}
