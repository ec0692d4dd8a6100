output "storage_account_name" {
  description = "Name of the storage account."
  value       = azurerm_storage_account.this.name
}

output "container_name" {
  description = "Name of the checkpoint container."
  value       = azurerm_storage_container.this.name
}

output "blob_endpoint" {
  description = "The account's blob endpoint (storage option account_url)."
  value       = azurerm_storage_account.this.primary_blob_endpoint
}

output "run_url_prefix" {
  description = "URL prefix for cloudckpt runs: pass run_url_prefix + \"<run name>\" to CheckpointManager, with AZURE_STORAGE_ACCOUNT_NAME set to storage_account_name."
  value       = local.run_url_prefix
}

output "container_scope" {
  description = "Resource Manager ID of the container: the scope of every role assignment."
  value       = local.container_scope
}

output "writer_identity_client_id" {
  description = "Client ID of the writer identity (AZURE_CLIENT_ID for DefaultAzureCredential), or null."
  value       = var.create_identities ? azurerm_user_assigned_identity.writer[0].client_id : null
}

output "reader_identity_client_id" {
  description = "Client ID of the reader identity, or null."
  value       = var.create_identities ? azurerm_user_assigned_identity.reader[0].client_id : null
}
