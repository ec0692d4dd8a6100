variable "bucket_name" {
  description = "Name of the checkpoint bucket to create."
  type        = string
}

variable "region" {
  description = "AWS region of the bucket."
  type        = string
  default     = "us-east-1"
}

variable "run_prefix" {
  description = "Key prefix for runs; the policies only reach objects under it."
  type        = string
  default     = "runs"
}

variable "force_destroy" {
  description = "Allow destroying a non-empty bucket (tests set true)."
  type        = bool
  default     = false
}

variable "abort_incomplete_multipart_upload_days" {
  description = "Days after which incomplete multipart uploads are aborted."
  type        = number
  default     = 3
}

variable "noncurrent_version_expiration_days" {
  description = "Days after which noncurrent object versions are deleted."
  type        = number
  default     = 30
}

variable "kms_key_arn" {
  description = "KMS key for SSE-KMS; null = SSE-S3 (AES256)."
  type        = string
  default     = null
}

variable "enforce_tls" {
  description = "Deny non-TLS requests with a bucket policy."
  type        = bool
  default     = true
}

variable "writer_can_delete" {
  description = "Whether the training writer may run GC (s3:DeleteObject)."
  type        = bool
  default     = true
}

variable "writer_role_name" {
  description = "Existing IAM role to attach the writer policy to (e.g. the training instance role)."
  type        = string
  default     = null
}

variable "restore_role_name" {
  description = "Existing IAM role to attach the read-only restore policy to."
  type        = string
  default     = null
}

variable "gc_role_name" {
  description = "Existing IAM role to attach the GC policy to."
  type        = string
  default     = null
}

variable "tags" {
  description = "Default tags for every resource."
  type        = map(string)
  default     = { "managed-by" = "terraform", "app" = "cloudckpt" }
}

# --- local endpoint (tests, emulators) ------------------------------------------------------

variable "endpoint_url" {
  description = "Send S3, IAM, STS and KMS calls to this endpoint (e.g. http://127.0.0.1:5000 for moto) and skip every real-AWS check. null = real AWS."
  type        = string
  default     = null
}

variable "access_key" {
  description = "Static access key (only for local endpoints; leave null to use the normal AWS credential chain)."
  type        = string
  default     = null
}

variable "secret_key" {
  description = "Static secret key (only for local endpoints)."
  type        = string
  default     = null
  sensitive   = true
}
