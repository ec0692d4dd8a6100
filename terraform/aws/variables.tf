variable "bucket_name" {
  description = "Name of the checkpoint bucket to create (globally unique)."
  type        = string
}

variable "run_prefix" {
  description = "Key prefix under which every run lives (s3://BUCKET/RUN_PREFIX/<run>/). The IAM policies only reach objects under it. Empty string = the whole bucket."
  type        = string
  default     = "runs"

  validation {
    condition     = !startswith(var.run_prefix, "/") && !endswith(var.run_prefix, "/") && !can(regex("[*?]", var.run_prefix))
    error_message = "run_prefix must not start or end with '/' and must not contain '*' or '?'."
  }
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete a bucket that still holds checkpoints (and all their versions). Keep false in production."
  type        = bool
  default     = false
}

variable "versioning_enabled" {
  description = "Enable S3 versioning: deleted or overwritten objects (old LATEST bodies, GC'd checkpoints) stay recoverable for noncurrent_version_expiration_days."
  type        = bool
  default     = true
}

variable "abort_incomplete_multipart_upload_days" {
  description = "Lifecycle: abort multipart uploads still incomplete this many days after they started (uploads abandoned by preempted trainers). Must exceed the longest checkpoint upload."
  type        = number
  default     = 3

  validation {
    condition     = var.abort_incomplete_multipart_upload_days >= 1
    error_message = "abort_incomplete_multipart_upload_days must be at least 1."
  }
}

variable "noncurrent_version_expiration_days" {
  description = "Lifecycle: permanently delete noncurrent object versions this many days after they became noncurrent (the recovery window for deleted checkpoints and old LATEST bodies)."
  type        = number
  default     = 30

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1
    error_message = "noncurrent_version_expiration_days must be at least 1."
  }
}

variable "noncurrent_versions_to_keep" {
  description = "Lifecycle: keep this many newest noncurrent versions of each key regardless of age (null = none kept beyond the age limit)."
  type        = number
  default     = null
}

variable "kms_key_arn" {
  description = "Encrypt with this KMS key (SSE-KMS, bucket keys on). null = SSE-S3 (AES256). The IAM policies then also grant the kms actions cloudckpt needs on this key."
  type        = string
  default     = null
}

variable "enforce_tls" {
  description = "Attach a bucket policy that denies every request not made over TLS."
  type        = bool
  default     = true
}

variable "writer_can_delete" {
  description = "Include the garbage-collection actions (s3:DeleteObject) in the writer policy, for trainers that run GC themselves. false = writers never delete; run GC under the separate GC policy."
  type        = bool
  default     = true
}

variable "create_restore_policy" {
  description = "Create a read-only policy for hosts that only restore checkpoints (cloudckpt restore / ls / show / verify)."
  type        = bool
  default     = true
}

variable "create_gc_policy" {
  description = "Create a policy for the garbage collector (cloudckpt gc): list, read, delete and abort stale multipart uploads."
  type        = bool
  default     = true
}

variable "policy_name_prefix" {
  description = "Prefix of the IAM policy names (default: the bucket name)."
  type        = string
  default     = null
}

variable "writer_role_name" {
  description = "Name of an existing IAM role (e.g. the training instance role) to attach the writer policy to. null = attach nothing."
  type        = string
  default     = null
}

variable "restore_role_name" {
  description = "Name of an existing IAM role to attach the read-only restore policy to. null = attach nothing."
  type        = string
  default     = null
}

variable "gc_role_name" {
  description = "Name of an existing IAM role to attach the GC policy to. null = attach nothing."
  type        = string
  default     = null
}

variable "tags" {
  description = "Tags for the bucket and the policies."
  type        = map(string)
  default     = {}
}
