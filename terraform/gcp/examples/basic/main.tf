# Example: a checkpoint bucket for one training service account and one restore-only account.
#
#   terraform init
#   terraform apply -var project_id=my-project -var bucket_name=my-team-checkpoints \
#     -var trainer_service_account=trainer@my-project.iam.gserviceaccount.com

terraform {
  required_version = ">= 1.5.0"

  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 5.30, < 8.0"
    }
  }
}

provider "google" {
  project = var.project_id
  region  = var.region
}

module "checkpoints" {
  source = "../.."

  project_id                             = var.project_id
  bucket_name                            = var.bucket_name
  location                               = upper(var.region)
  run_prefix                             = var.run_prefix
  force_destroy                          = var.force_destroy
  abort_incomplete_multipart_upload_days = 3
  noncurrent_version_expiration_days     = 30
  writer_service_accounts                = var.trainer_service_account == null ? [] : [var.trainer_service_account]
  restore_service_accounts               = var.restore_service_accounts
}

variable "project_id" {
  description = "GCP project."
  type        = string
}

variable "bucket_name" {
  description = "Name of the checkpoint bucket."
  type        = string
}

variable "region" {
  description = "Region of the bucket (put it where the trainers run)."
  type        = string
  default     = "us-central1"
}

variable "run_prefix" {
  description = "Object prefix for runs."
  type        = string
  default     = "runs"
}

variable "force_destroy" {
  description = "Allow destroying a non-empty bucket."
  type        = bool
  default     = false
}

variable "trainer_service_account" {
  description = "Email of the training jobs' service account (null = grant nothing)."
  type        = string
  default     = null
}

variable "restore_service_accounts" {
  description = "Emails of restore-only service accounts."
  type        = list(string)
  default     = []
}

output "bucket_name" {
  value = module.checkpoints.bucket_name
}

output "run_url_prefix" {
  value = module.checkpoints.run_url_prefix
}

output "writer_role" {
  value = module.checkpoints.writer_role
}
