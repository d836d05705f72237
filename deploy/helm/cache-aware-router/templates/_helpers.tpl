{{- define "car.name" -}}{{ .Release.Name }}-cache-aware-router{{- end -}}

{{- define "car.redisUrl" -}}
{{- if .Values.redis.enabled -}}redis://{{ include "car.name" . }}-redis:6379/0{{- else -}}{{ .Values.redis.url }}{{- end -}}
{{- end -}}

{{- define "car.adminSecret" -}}
{{- if .Values.adminToken.existingSecret -}}{{ .Values.adminToken.existingSecret }}{{- else -}}{{ include "car.name" . }}-admin{{- end -}}
{{- end -}}
