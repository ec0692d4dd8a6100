# Example: a checkpoint bucket with least-privilege policies for a training role.
#
#   terraform init && terraform apply -var bucket_name=my-team-checkpoints
#
# Setting endpoint_url points every AWS API this example uses at one S3/IAM/STS/KMS-compatible
# endpoint (the tests use a local moto server) and turns off every call that would otherwise
# go to real AWS (credential validation, account id lookup, instance metadata).

terraform {
  required_version = ">= 1.5.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.60, < 7.0"
    }
  }
}

locals {
  local_endpoint = var.endpoint_url != null
}

provider "aws" {
  region     = var.region
  access_key = var.access_key
  secret_key = var.secret_key

  # Against a local endpoint there is no real account, metadata service or region list.
  skip_credentials_validation = local.local_endpoint
  skip_requesting_account_id  = local.local_endpoint
  skip_metadata_api_check     = local.local_endpoint
  skip_region_validation      = local.local_endpoint
  s3_use_path_style           = local.local_endpoint

  # null endpoints mean the provider's defaults (real AWS).
  endpoints {
    s3  = var.endpoint_url
    iam = var.endpoint_url
    sts = var.endpoint_url
    kms = var.endpoint_url
  }

  default_tags {
    tags = var.tags
  }
}

module "checkpoints" {
  source = "../.."

  bucket_name                            = var.bucket_name
  run_prefix                             = var.run_prefix
  force_destroy                          = var.force_destroy
  abort_incomplete_multipart_upload_days = var.abort_incomplete_multipart_upload_days
  noncurrent_version_expiration_days     = var.noncurrent_version_expiration_days
  kms_key_arn                            = var.kms_key_arn
  enforce_tls                            = var.enforce_tls
  writer_can_delete                      = var.writer_can_delete
  writer_role_name                       = var.writer_role_name
  restore_role_name                      = var.restore_role_name
  gc_role_name                           = var.gc_role_name
}
