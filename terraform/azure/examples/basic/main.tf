# Example: a checkpoint container with a writer identity for the trainers and a reader identity
# for restore-only hosts.
#
#   pip install '.[azure]' azure-identity    # in the repository root; then, here:
#   terraform init
#   terraform apply -var subscription_id=... -var storage_account_name=myteamckpts
#   export AZURE_STORAGE_ACCOUNT_NAME=myteamckpts AZURE_CLIENT_ID=$(terraform output -raw writer_identity_client_id)

terraform {
  required_version = ">= 1.5.0"

  required_providers {
    azurerm = {
      source  = "hashicorp/azurerm"
      version = ">= 4.9, < 5.0"
    }
  }
}

provider "azurerm" {
  features {}
  subscription_id = var.subscription_id
  # Data-plane calls (the container) with Entra ID: the module turns shared keys off.
  storage_use_azuread = true
}

resource "azurerm_resource_group" "this" {
  name     = var.resource_group_name
  location = var.location
}

module "checkpoints" {
  source = "../.."

  resource_group_name                = azurerm_resource_group.this.name
  location                           = azurerm_resource_group.this.location
  storage_account_name               = var.storage_account_name
  container_name                     = "checkpoints"
  run_prefix                         = "runs"
  noncurrent_version_expiration_days = 30
  reader_principal_ids               = var.reader_principal_ids
}

variable "subscription_id" {
  description = "Azure subscription."
  type        = string
}

variable "resource_group_name" {
  description = "Resource group to create."
  type        = string
  default     = "cloudckpt"
}

variable "location" {
  description = "Region (put it where the trainers run)."
  type        = string
  default     = "westeurope"
}

variable "storage_account_name" {
  description = "Storage account to create (globally unique)."
  type        = string
}

variable "reader_principal_ids" {
  description = "Object IDs of existing restore-only principals."
  type        = list(string)
  default     = []
}

output "run_url_prefix" {
  value = module.checkpoints.run_url_prefix
}

output "writer_identity_client_id" {
  value = module.checkpoints.writer_identity_client_id
}

output "reader_identity_client_id" {
  value = module.checkpoints.reader_identity_client_id
}
