{{- /* <release>-cache-aware-router, or the release name alone when it already says
cache-aware-router (Helm's usual fullname rule): `helm install cache-aware-router .`
renders the names of deploy/kubernetes/fleet.yaml. */ -}}
{{- define "car.name" -}}
{{- if contains "cache-aware-router" .Release.Name -}}{{ .Release.Name | trunc 63 }}
{{- else -}}{{ printf "%s-cache-aware-router" .Release.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "car.redisUrl" -}}
{{- if .Values.redis.enabled -}}redis://{{ include "car.name" . }}-redis:6379/0{{- else -}}{{ .Values.redis.url }}{{- end -}}
{{- end -}}

{{- define "car.adminSecret" -}}
{{- if .Values.adminToken.existingSecret -}}{{ .Values.adminToken.existingSecret }}{{- else -}}{{ include "car.name" . }}-admin{{- end -}}
{{- end -}}
