{{/* Labels of one fairserve service: name and part-of, as deploy/k8s has them. */}}
{{- define "fairserve.labels" -}}
app.kubernetes.io/name: {{ . }}
app.kubernetes.io/part-of: fairserve
{{- end }}

{{/* Every scheduler shard's address, comma-separated: scheduler-<i>.scheduler:50051 (the
StatefulSet's pods behind the headless Service), for SCHEDULER_SHARDS and SCHEDULER_PEERS. */}}
{{- define "fairserve.schedulerShards" -}}
{{- $addresses := list -}}
{{- range $i := until (int .Values.scheduler.shards) -}}
{{- $addresses = append $addresses (printf "scheduler-%d.scheduler:50051" $i) -}}
{{- end -}}
{{- join "," $addresses -}}
{{- end }}

{{/* <prefix><service>:<tag>; a worker with GPUs takes the CUDA build, <tag>-cuda (`make image VARIANT=cuda`). */}}
{{- define "fairserve.image" -}}
{{ .root.Values.image.prefix }}{{ .service }}:{{ .root.Values.image.tag }}{{ if and (eq .service "worker") (gt (int .root.Values.worker.gpu) 0) }}-cuda{{ end }}
{{- end }}

{{/* The pod security context of every fairserve pod: non-root, seccomp. */}}
{{- define "fairserve.podSecurity" -}}
automountServiceAccountToken: false
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  seccompProfile:
    type: RuntimeDefault
{{- end }}

{{/* The container security context: no privilege, read-only root, no capability. */}}
{{- define "fairserve.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  runAsNonRoot: true
  capabilities:
    drop:
    - ALL
{{- end }}

{{/* Scrape annotations of a pod whose metrics are on port . */}}
{{- define "fairserve.scrape" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ . | quote }}
prometheus.io/path: /metrics
{{- end }}

{{- define "fairserve.mounts" -}}
- name: secrets
  mountPath: /run/secrets/fairserve
  readOnly: true
- name: cache
  mountPath: /home/fairserve/.cache
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* Volumes: the Secret's keys in `.keys` only (least privilege), cache, tmp. */}}
{{- define "fairserve.volumes" -}}
- name: secrets
  secret:
    secretName: {{ .root.Values.existingSecret }}
    items:
    {{- range .keys }}
    - key: {{ . }}
      path: {{ . }}
    {{- end }}
- name: cache
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "fairserve.grpcProbes" -}}
startupProbe:
  grpc:
    port: {{ . }}
  periodSeconds: 5
  failureThreshold: 60
readinessProbe:
  grpc:
    port: {{ . }}
  periodSeconds: 5
livenessProbe:
  grpc:
    port: {{ . }}
  periodSeconds: 10
  failureThreshold: 3
{{- end }}

{{/* The model volume (never in an image): the claim that holds it, else an
emptyDir the worker, or the gateway's model-init step, converts it into. */}}
{{- define "fairserve.modelVolume" -}}
- name: model
{{- if .Values.model.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.existingClaim }}
    readOnly: true
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}
