variable "project_id" {
  description = "GCP project that owns the bucket (and the custom IAM role)."
  type        = string
}

variable "bucket_name" {
  description = "Name of the checkpoint bucket to create (globally unique)."
  type        = string
}

variable "location" {
  description = "Bucket location: a region (e.g. us-central1, cheapest and closest to the trainers) or a multi-region."
  type        = string
  default     = "US-CENTRAL1"
}

variable "storage_class" {
  description = "Default storage class. Checkpoints are written and read often: keep STANDARD."
  type        = string
  default     = "STANDARD"
}

variable "run_prefix" {
  description = "Object prefix under which every run lives (gs://BUCKET/RUN_PREFIX/<run>/). With restrict_to_run_prefix the object permissions only apply under it. Empty string = the whole bucket."
  type        = string
  default     = "runs"

  validation {
    condition     = !startswith(var.run_prefix, "/") && !endswith(var.run_prefix, "/") && !can(regex("[\"*?]", var.run_prefix))
    error_message = "run_prefix must not start or end with '/' and must not contain '\"', '*' or '?'."
  }
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete a bucket that still holds checkpoints. Keep false in production."
  type        = bool
  default     = false
}

variable "versioning_enabled" {
  description = "Keep noncurrent generations (old LATEST bodies, GC'd checkpoints) for noncurrent_version_expiration_days."
  type        = bool
  default     = true
}

variable "noncurrent_version_expiration_days" {
  description = "Lifecycle: delete noncurrent generations this many days after they became noncurrent."
  type        = number
  default     = 30

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1
    error_message = "noncurrent_version_expiration_days must be at least 1."
  }
}

variable "abort_incomplete_multipart_upload_days" {
  description = "Lifecycle: abort XML-API multipart uploads still incomplete after this many days."
  type        = number
  default     = 3

  validation {
    condition     = var.abort_incomplete_multipart_upload_days >= 1
    error_message = "abort_incomplete_multipart_upload_days must be at least 1."
  }
}

variable "soft_delete_retention_seconds" {
  description = "GCS soft-delete retention. 0 turns soft delete off (versioning already keeps deleted checkpoints recoverable); GCS's default is 604800 (7 days)."
  type        = number
  default     = 0
}

variable "kms_key_name" {
  description = "Cloud KMS key for default CMEK encryption (projects/.../cryptoKeys/...). null = Google-managed encryption. The GCS service agent needs roles/cloudkms.cryptoKeyEncrypterDecrypter on it."
  type        = string
  default     = null
}

variable "writer_service_accounts" {
  description = "Service account emails of the training jobs (save, resume, commit, GC)."
  type        = list(string)
  default     = []
}

variable "restore_service_accounts" {
  description = "Service account emails that only restore or inspect checkpoints (roles/storage.objectViewer)."
  type        = list(string)
  default     = []
}

variable "use_custom_role" {
  description = "Grant writers a custom role with exactly the permissions cloudckpt uses (storage.objects.create/delete/get/list) instead of roles/storage.objectUser."
  type        = bool
  default     = true
}

variable "custom_role_id" {
  description = "ID of the custom writer role (project-level; letters, digits, underscores and periods)."
  type        = string
  default     = "cloudckptWriter"
}

variable "restrict_to_run_prefix" {
  description = "Add an IAM condition so object permissions apply only under run_prefix (bucket-level permissions such as storage.objects.list still apply to the bucket)."
  type        = bool
  default     = true
}

variable "labels" {
  description = "Labels for the bucket."
  type        = map(string)
  default     = {}
}
