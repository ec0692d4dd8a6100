variable "resource_group_name" {
  description = "Existing resource group for the storage account and the identities."
  type        = string
}

variable "location" {
  description = "Azure region (put it where the trainers run), e.g. westeurope."
  type        = string
}

variable "storage_account_name" {
  description = "Name of the storage account to create (3-24 lowercase letters and digits, globally unique)."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9]{3,24}$", var.storage_account_name))
    error_message = "storage_account_name must be 3-24 lowercase letters and digits."
  }
}

variable "container_name" {
  description = "Name of the checkpoint container (3-63 lowercase letters, digits and hyphens)."
  type        = string
  default     = "checkpoints"

  validation {
    condition     = can(regex("^[a-z0-9]([a-z0-9]|-[a-z0-9]){2,62}$", var.container_name))
    error_message = "container_name must be 3-63 lowercase letters, digits and single hyphens, starting and ending with a letter or digit."
  }
}

variable "run_prefix" {
  description = "Blob prefix under which runs live (az://CONTAINER/RUN_PREFIX/<run>/). Empty string = the whole container."
  type        = string
  default     = "runs"

  validation {
    condition     = !startswith(var.run_prefix, "/") && !endswith(var.run_prefix, "/")
    error_message = "run_prefix must not start or end with '/'."
  }
}

variable "replication_type" {
  description = "Account replication: LRS, ZRS, GRS, RAGRS, GZRS or RAGZRS."
  type        = string
  default     = "ZRS"
}

variable "shared_access_key_enabled" {
  description = "Allow account-key and SAS access. false (the default) leaves Entra ID roles as the only way in; set true only if you must use AZURE_STORAGE_ACCOUNT_KEY, a connection string or SAS tokens (the provider then also uses keys)."
  type        = bool
  default     = false
}

variable "versioning_enabled" {
  description = "Keep previous versions of overwritten and deleted blobs (old LATEST bodies, GC'd checkpoints) for noncurrent_version_expiration_days."
  type        = bool
  default     = true
}

variable "noncurrent_version_expiration_days" {
  description = "Lifecycle: delete previous blob versions this many days after they were created."
  type        = number
  default     = 30

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1
    error_message = "noncurrent_version_expiration_days must be at least 1."
  }
}

variable "soft_delete_retention_days" {
  description = "Blob and container soft-delete retention (1-365 days)."
  type        = number
  default     = 7

  validation {
    condition     = var.soft_delete_retention_days >= 1 && var.soft_delete_retention_days <= 365
    error_message = "soft_delete_retention_days must be between 1 and 365."
  }
}

variable "create_identities" {
  description = "Create a user-assigned managed identity for writers and one for readers."
  type        = bool
  default     = true
}

variable "identity_name_prefix" {
  description = "Name prefix of the created identities (<prefix>-writer, <prefix>-reader)."
  type        = string
  default     = "cloudckpt"
}

variable "writer_principal_ids" {
  description = "Object IDs of existing principals (managed identities, service principals, groups) that train: Storage Blob Data Contributor on the container."
  type        = list(string)
  default     = []
}

variable "reader_principal_ids" {
  description = "Object IDs of existing principals that only restore or inspect: Storage Blob Data Reader on the container."
  type        = list(string)
  default     = []
}

variable "tags" {
  description = "Tags for the storage account and the identities."
  type        = map(string)
  default     = {}
}
