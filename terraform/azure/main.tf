# The checkpoint container on Azure Blob Storage: a StorageV2 account (HTTPS and TLS 1.2 only, no
# public blobs, shared keys off by default so access goes through Entra ID roles), blob versioning
# and soft delete, a lifecycle policy bounding what versioning keeps, and least-privilege role
# assignments scoped to the one container.

resource "azurerm_storage_account" "this" {
  name                     = var.storage_account_name
  resource_group_name      = var.resource_group_name
  location                 = var.location
  account_kind             = "StorageV2"
  account_tier             = "Standard"
  account_replication_type = var.replication_type
  access_tier              = "Hot"

  https_traffic_only_enabled      = true
  min_tls_version                 = "TLS1_2"
  allow_nested_items_to_be_public = false
  shared_access_key_enabled       = var.shared_access_key_enabled
  # cloudckpt speaks the Blob API; its conditional writes were measured on flat namespaces.
  is_hns_enabled = false

  blob_properties {
    versioning_enabled = var.versioning_enabled

    delete_retention_policy {
      days = var.soft_delete_retention_days
    }

    container_delete_retention_policy {
      days = var.soft_delete_retention_days
    }
  }

  tags = var.tags
}

resource "azurerm_storage_container" "this" {
  name                  = var.container_name
  storage_account_id    = azurerm_storage_account.this.id
  container_access_type = "private"
}

locals {
  # The Azure Resource Manager scope of the container: role assignments reach it and nothing else.
  container_scope = "${azurerm_storage_account.this.id}/blobServices/default/containers/${azurerm_storage_container.this.name}"
  run_url_prefix  = var.run_prefix == "" ? "az://${azurerm_storage_container.this.name}/" : "az://${azurerm_storage_container.this.name}/${var.run_prefix}/"

  writer_principals = concat(
    var.create_identities ? [azurerm_user_assigned_identity.writer[0].principal_id] : [],
    var.writer_principal_ids,
  )
  reader_principals = concat(
    var.create_identities ? [azurerm_user_assigned_identity.reader[0].principal_id] : [],
    var.reader_principal_ids,
  )
}

# Identities for the training jobs (writer) and for restore-only hosts (reader); attach them to
# the VMs or pods, or pass existing principals in writer_principal_ids / reader_principal_ids.
resource "azurerm_user_assigned_identity" "writer" {
  count = var.create_identities ? 1 : 0

  name                = "${var.identity_name_prefix}-writer"
  resource_group_name = var.resource_group_name
  location            = var.location
  tags                = var.tags
}

resource "azurerm_user_assigned_identity" "reader" {
  count = var.create_identities ? 1 : 0

  name                = "${var.identity_name_prefix}-reader"
  resource_group_name = var.resource_group_name
  location            = var.location
  tags                = var.tags
}

# Storage Blob Data Contributor: read, write, delete and list blobs (cloudckpt's puts, block
# uploads, conditional commits and GC), on this container only.
resource "azurerm_role_assignment" "writer" {
  count = length(local.writer_principals)

  scope                = local.container_scope
  role_definition_name = "Storage Blob Data Contributor"
  principal_id         = local.writer_principals[count.index]
}

# Storage Blob Data Reader: read and list blobs (restore, ls, show, verify), on this container only.
resource "azurerm_role_assignment" "reader" {
  count = length(local.reader_principals)

  scope                = local.container_scope
  role_definition_name = "Storage Blob Data Reader"
  principal_id         = local.reader_principals[count.index]
}

# With versioning on, every LATEST commit and every GC deletion leaves a previous version; keep
# them for the recovery window only. (Uncommitted blocks of abandoned uploads need no rule: Azure
# discards them itself after 7 days.)
resource "azurerm_storage_management_policy" "this" {
  storage_account_id = azurerm_storage_account.this.id

  rule {
    name    = "cloudckpt-expire-previous-versions"
    enabled = true

    filters {
      blob_types   = ["blockBlob"]
      prefix_match = ["${azurerm_storage_container.this.name}/${var.run_prefix}"]
    }

    actions {
      version {
        delete_after_days_since_creation = var.noncurrent_version_expiration_days
      }
    }
  }
}
