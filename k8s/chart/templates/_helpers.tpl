{{/* The rendered RayService of the chosen variant, as a dict. */}}
{{- define "prefillshare.rayservice" -}}
{{- $file := printf "files/rayservice-%s.yaml" .Values.variant -}}
{{- $raw := .Files.Get $file -}}
{{- if not $raw -}}
{{- fail (printf "variant %q: the chart has no %s (variants are rendered by `prefillshare k8s render`)" .Values.variant $file) -}}
{{- end -}}
{{- $raw -}}
{{- end -}}
