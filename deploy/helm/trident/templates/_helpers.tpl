{{- define "trident.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "trident.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The stage models the modes use, each once (trident.core.protocol.stages_for), as a JSON list. */}}
{{- define "trident.stages" -}}
{{- $chains := dict "epd" (list "generate") "e_pd" (list "encode" "prefill_decode") "e_p_d" (list "encode" "prefill" "decode") "ep_d" (list "encode_prefill" "decode") -}}
{{- $stages := list -}}
{{- range $mode := .Values.modes -}}
{{- if not (hasKey $chains $mode) -}}
{{- fail (printf "modes: unknown mode %q; modes: epd, e_pd, e_p_d, ep_d" $mode) -}}
{{- end -}}
{{- range $stage := get $chains $mode -}}
{{- if not (has $stage $stages) -}}{{- $stages = append $stages $stage -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- toJson $stages -}}
{{- end -}}

{{- define "trident.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "trident.fullname" .)) -}}
{{- end -}}

{{/* The secret every process of the deployment takes from its environment (never from argv). Stage workers bind
     through the head's bind model with it: only the head gets the repository-API token (trident.tokenEnv). */}}
{{- define "trident.secretEnv" -}}
- name: TRIDENT_TRANSFER_SECRET
  valueFrom: {secretKeyRef: {name: {{ include "trident.secretName" . }}, key: transfer-secret}}
- name: HF_HUB_OFFLINE
  value: "1"
{{- end -}}

{{- define "trident.tokenEnv" -}}
- name: TRIDENT_ACCESS_TOKEN
  valueFrom: {secretKeyRef: {name: {{ include "trident.secretName" . }}, key: access-token}}
{{- end -}}
